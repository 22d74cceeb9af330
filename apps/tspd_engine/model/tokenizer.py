"""What a front door needs from a tokenizer, and the byte tokenizer of the seeded test model.

:class:`Tokenizer` is the interface the node endpoint and the router use: encode a prompt
(with the BOS the model wants), decode ids (special tokens skipped), the ids that end a
generation (a model may have several EOS ids), and a chat prompt from OpenAI messages through
the model's chat template. A real model's is :class:`~tspd_engine.model.hf_tokenizer.HfTokenizer`
(``tokenizer.json`` or a GGUF's vocabulary; :func:`~tspd_engine.model.hf_tokenizer.load_tokenizer`).

:class:`ByteTokenizer` serves the seeded model: one token per UTF-8 byte, plus three specials.
Ids 0..255 are the bytes themselves; 256 = BOS, 257 = EOS, 258 = PAD. Decoding drops the
specials and replaces invalid UTF-8 (a generation may stop inside a multi-byte character). Its
chat format is tspd's own plain one (:data:`BYTE_CHAT_TEMPLATE`), since the seeded model was
never trained on any.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tspd_engine.errors import RequestError
from tspd_engine.model.chat_template import ChatTemplate, Message

BYTE_VOCAB_SIZE = 259
#: The byte model's chat format: one ``<|role|>content`` line per message, then the prompt.
BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class Tokenizer(Protocol):
    """A model's tokenizer as the front doors use it. Implementations are immutable after
    construction and safe to share between threads."""

    @property
    def eos_token_id(self) -> int:
        """The model's own EOS id (the one the engine stops on)."""
        ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation (``eos_token_id`` first)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Ids of ``text``; with ``add_bos``, the special tokens the model's config asks for."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens skipped; :class:`RequestError` for unknown ids."""
        ...

    def chat_prompt(self, messages: Sequence[Message]) -> list[int]:
        """The prompt ids of a conversation, ready for the assistant's answer (raises
        :class:`~tspd_engine.model.chat_template.TemplateError`)."""
        ...


class ByteTokenizer:
    """Byte-level tokenizer; stateless and thread-safe."""

    BOS = 256
    EOS = 257
    PAD = 258
    vocab_size = BYTE_VOCAB_SIZE
    _template = ChatTemplate(BYTE_CHAT_TEMPLATE)

    @property
    def eos_token_id(self) -> int:
        return self.EOS

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

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

    @classmethod
    def render_chat(cls, messages: Sequence[Message]) -> str:
        """The plain format's text of ``messages``, ready for the assistant's answer."""
        return cls._template.render(messages, add_generation_prompt=True)

    def chat_prompt(self, messages: Sequence[Message]) -> list[int]:
        """BOS, then the plain format's bytes (the template cannot spell BOS as text)."""
        return self.encode(self.render_chat(messages))
