"""The default tokenizer: one token per UTF-8 byte, plus three specials.

Ids 0..255 are the bytes themselves; 256 = BOS, 257 = EOS, 258 = PAD. Decoding drops the
specials and replaces invalid UTF-8 (a generation may stop inside a multi-byte character).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tspd_engine.errors import RequestError

BYTE_VOCAB_SIZE = 259


class Tokenizer(Protocol):
    """What the engine front door needs from a tokenizer (the byte one, or a user's)."""

    @property
    def eos_token_id(self) -> int: ...

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Byte-level tokenizer; stateless and thread-safe."""

    BOS = 256
    EOS = 257
    PAD = 258
    vocab_size = BYTE_VOCAB_SIZE

    @property
    def eos_token_id(self) -> int:
        return self.EOS

    @property
    def bos_token_id(self) -> int:
        return self.BOS

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """UTF-8 bytes of ``text``, preceded by BOS unless ``add_bos`` is false."""
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the byte ids in ``ids``; specials are skipped, bad UTF-8 is replaced."""
        for i in ids:
            if not 0 <= i < self.vocab_size:
                limit = BYTE_VOCAB_SIZE - 1
                raise RequestError(f"token id {i} outside the byte vocabulary 0..{limit}")
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
