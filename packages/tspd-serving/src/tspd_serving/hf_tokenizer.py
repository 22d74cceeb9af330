"""A real model's tokenizer: the ``tokenizers`` library, with its config and chat template.

:func:`load_tokenizer` reads it from where the weights came from:

* a directory: ``tokenizer.json``, plus ``tokenizer_config.json`` (``bos_token``,
  ``eos_token``, ``add_bos_token``, ``chat_template``), ``generation_config.json`` and
  ``config.json`` (their ``eos_token_id``, one or a list: Llama 3 Instruct ends a turn with
  ``<|eot_id|>``, which is not ``config.json``'s EOS) and ``chat_template.jinja``;
* a GGUF file: :func:`~tspd_serving.gguf_vocab.gguf_tokenizer`, BOS/EOS (and
  llama.cpp's other end-of-generation ids, EOT and EOM) from ``tokenizer.ggml.*``, the
  template from ``tokenizer.chat_template``;
* nothing (the seeded model): the :class:`ByteTokenizer`.

Missing or corrupt files are refused at start with one line naming the file.

Encoding goes through ``tokenizers``' batch call, which releases the GIL while the Rust code
works: a front door that tokenizes a long prompt on a worker thread leaves its event loop
free (the single-text call holds the GIL throughout: 0.4 s for 700 KB of SmolLM2 text).

:attr:`HfTokenizer.max_token_bytes` is read from the tokenizer's own description: the longest
piece of its vocabulary, when its normalizer and pre-tokenizer never drop input characters and
its model never maps an unknown stretch of text to one id (byte-level BPE, or BPE with byte
fallback and every byte's piece). A Unicode normalization (NFC, NFKC, ...) or lowercasing may
shrink text, by at most 4 bytes to 1 (one code point of up to 4 bytes to one of 1); the bound
allows for it. A byte-level vocabulary may lack a byte's piece, which its BPE then drops (as
Hugging Face's does): SmolLM2's has none for six ASCII control characters, nor for the lead
bytes of characters past U+3FFFF. :meth:`HfTokenizer.least_tokens` counts such ASCII
characters out, and, where a lead byte is missing, counts every other character of a
non-ASCII text as one byte (it keeps at least that many).
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as RustTokenizer

from tspd_serving.chat_template import ChatTemplate, Message
from tspd_serving.errors import CheckpointError, ConfigError, RequestError, TemplateError
from tspd_serving.gguf_file import open_gguf
from tspd_serving.gguf_vocab import gguf_tokenizer
from tspd_serving.models import is_gguf
from tspd_serving.tokenizer import ByteTokenizer, ChatText, ContentSpecials, Tokenizer

_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")
#: Characters that stand in for content's special-token text while the template renders (one
#: no message content holds is used: private-use code points, which text rarely holds).
_MARKS = ("\ue000", "\ue001", "\ue002", "\ue003", "\U000f0000", "\U000f0001", "\U000f0002")
#: Normalizers that never shrink text, and those that shrink it by at most 4 bytes to 1.
_KEEPS, _SHRINKS = {"Prepend"}, {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
#: Pre-tokenizers that never drop input characters (Split and Punctuation unless "Removed").
_SPLITS = {"ByteLevel", "Digits", "Metaspace", "Split", "Punctuation", "UnicodeScripts"}


class HfTokenizer:
    """A ``tokenizers.Tokenizer`` with the model's BOS/EOS rules and chat template.
    Immutable after construction (but for a copy made once, under a lock, on first use);
    ``tokenizers`` encodes and decodes thread-safely."""

    def __init__(
        self,
        tok: RustTokenizer,
        *,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        where: str = "",
    ) -> None:
        if not eos_token_ids:
            raise CheckpointError(f"{where}: the tokenizer names no EOS token")
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        for i in (*eos_token_ids, *([] if bos_token_id is None else [bos_token_id])):
            if not 0 <= i < self.vocab_size:
                raise CheckpointError(f"{where}: special token id {i} outside the vocabulary")
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos and bos_token_id is not None
        self.where = where
        # What templates see as bos_token / eos_token: the tokenizer config's strings, else
        # the pieces of the ids.
        special = {
            "bos_token": self._piece(bos_token_id),
            "eos_token": self._piece(eos_token_ids[0]),
        }
        special |= special_tokens or {}
        self.template = ChatTemplate(chat_template, special) if chat_template else None
        self._bound = _text_bound(json.loads(tok.to_str()))
        self.max_token_bytes = None if self._bound is None else self._bound[0]
        names = [a.content for a in tok.get_added_tokens_decoder().values() if a.special]
        longest_first = sorted(names, key=len, reverse=True)
        self._specials = re.compile("|".join(map(re.escape, longest_first))) if names else None
        self._plain_copy: RustTokenizer | None = None
        self._plain_lock = threading.Lock()

    def _piece(self, i: int | None) -> str:
        return "" if i is None else (self._tok.id_to_token(i) or "")

    @property
    def eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    def least_tokens(self, text: str) -> int:
        if self._bound is None:
            return 0
        size, dropped, lossy = self._bound
        if lossy and not text.isascii():
            kept = len(text)  # a character whose lead byte is dropped keeps its others
        else:
            kept = len(text.encode("utf-8", "surrogatepass"))
        kept -= sum(text.count(c) for c in dropped)  # each one byte, dropped
        return -(-kept // size)

    @property
    def _plain(self) -> RustTokenizer:
        """A copy that never parses special tokens (the flag is the object's state, so the
        shared tokenizer keeps its own), made on first use: only content that spells special
        tokens needs it (30 MB for SmolLM2's vocabulary)."""
        with self._plain_lock:
            if self._plain_copy is None:
                plain = RustTokenizer.from_str(self._tok.to_str())
                plain.encode_special_tokens = True
                self._plain_copy = plain
            return self._plain_copy

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_bos and self.add_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise RequestError(f"token id {i} outside the vocabulary 0..{self.vocab_size - 1}")
        text: str = self._tok.decode(list(ids), skip_special_tokens=True)
        return text

    def chat_text(
        self, messages: Sequence[Message], content: ContentSpecials = ContentSpecials.PARSE
    ) -> ChatText:
        if self.template is None:
            raise TemplateError(
                "this model has no chat template (use /v1/completions, or a model that has one)"
            )
        if content is ContentSpecials.PARSE or self._specials is None:
            return ChatText((self.template.render(messages),))
        return self._literal_specials(messages)

    def _literal_specials(self, messages: Sequence[Message]) -> ChatText:
        """Render with each special-token text in content replaced by a placeholder (a mark,
        its index, the mark), then cut the text at the placeholders."""
        pattern = self._specials
        assert pattern is not None
        texts = [m.get("content") for m in messages]
        if not any(isinstance(t, str) and pattern.search(t) for t in texts):
            return ChatText((self.template.render(messages),))  # type: ignore[union-attr]
        mark = next((c for c in _MARKS if not any(c in t for t in texts if isinstance(t, str))),
                    None)  # fmt: skip
        if mark is None:
            raise TemplateError(
                "the messages hold every character this server marks special tokens in "
                "content with; leave out private-use characters"
            )
        literals: list[str] = []

        def placeholder(found: re.Match[str]) -> str:
            literals.append(found.group())
            return f"{mark}{len(literals) - 1}{mark}"

        marked = [
            {**m, "content": pattern.sub(placeholder, m["content"])}
            if isinstance(m.get("content"), str)
            else m
            for m in messages
        ]
        rendered = self.template.render(marked)  # type: ignore[union-attr]
        parts = re.split(f"{re.escape(mark)}([0-9]+){re.escape(mark)}", rendered)
        for i in range(1, len(parts), 2):
            index = int(parts[i])
            parts[i] = literals[index] if index < len(literals) else ""
        return ChatText(tuple(parts))

    def chat_ids(self, chat: ChatText) -> list[int]:
        # The template writes the special tokens it wants (BOS included), as transformers'
        # apply_chat_template: the text is not given another BOS.
        if len(chat.parts) == 1:
            return self.encode(chat.parts[0], add_bos=False)
        ids: list[int] = []
        for i, part in enumerate(chat.parts):
            tok = self._plain if i % 2 else self._tok
            ids += tok.encode_batch([part], add_special_tokens=False)[0].ids
        return ids

    def chat_prompt(self, messages: Sequence[Message]) -> list[int]:
        return self.chat_ids(self.chat_text(messages))


def _text_bound(described: dict[str, Any]) -> tuple[int, str, bool] | None:
    """From a ``tokenizers`` description (its JSON): the most input bytes one token stands
    for, the ASCII characters its vocabulary cannot spell (they vanish), and whether it lacks
    a lead byte of longer characters (each such character loses that byte); None when the
    tokenizer may drop other text or map a stretch of it to one id."""
    factor = _shrink(described.get("normalizer"))
    pre = described.get("pre_tokenizer")
    model = described.get("model") or {}
    if factor is None or not _keeps_text(pre) or model.get("type") != "BPE":
        return None
    vocab = model.get("vocab") or {}
    if "ByteLevel" in json.dumps(pre):
        missing = [b for b, c in enumerate(_BYTE_CHARS) if c not in vocab]
        if any(0x80 <= b <= 0xBF for b in missing):
            return None  # a continuation byte: a character could lose all of its bytes
        # A byte-level piece spells one input byte per character. (C0, C1 and F5..FF never
        # occur in UTF-8.)
        pieces = max((len(t) for t in vocab), default=1)
        dropped = "".join(chr(b) for b in missing if b < 0x80)
        lossy = any(0xC2 <= b <= 0xF4 for b in missing)
    elif model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        # A piece's UTF-8 bytes are at least the input bytes it stands for (the space
        # marker, <0xNN> byte pieces).
        pieces, dropped, lossy = max((len(t.encode()) for t in vocab), default=1), "", False
    else:
        return None  # an unknown character would become the unknown id, or vanish
    added = [a.get("content", "") for a in described.get("added_tokens") or []]
    return factor * max(pieces, *(len(str(a).encode()) for a in added), 1), dropped, lossy


def _byte_chars() -> list[str]:
    """Byte-level BPE's character for each byte value (GPT-2's table: printable Latin-1
    stands for itself, the other bytes for 256 and up, in order)."""
    itself = {*range(33, 127), *range(161, 173), *range(174, 256)}
    chars, extra = [], 0
    for b in range(256):
        chars.append(chr(b) if b in itself else chr(256 + extra))
        extra += b not in itself
    return chars


_BYTE_CHARS = _byte_chars()


def _shrink(normalizer: Any) -> int | None:
    """How many input bytes one normalized byte may stand for (None: unbounded)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factors = [_shrink(n) for n in normalizer.get("normalizers", [])]
        return None if None in factors else math.prod(f for f in factors if f is not None)
    if kind == "Replace":
        old, new = normalizer.get("pattern", {}).get("String"), normalizer.get("content", "")
        return 1 if isinstance(old, str) and len(str(new).encode()) >= len(old.encode()) else None
    return 1 if kind in _KEEPS else 4 if kind in _SHRINKS else None


def _keeps_text(pre: Any) -> bool:
    """Whether a pre-tokenizer passes every input character on."""
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") in _SPLITS and pre.get("behavior") != "Removed"


def load_tokenizer(path: Path | None) -> Tokenizer:
    """The tokenizer of the model at ``path`` (a directory or GGUF file; None: the byte one)."""
    if path is None:
        return ByteTokenizer()
    if is_gguf(path):
        return _from_gguf(path)
    return _from_directory(path)


def _from_gguf(path: Path) -> HfTokenizer:
    f = open_gguf(path)
    tok = gguf_tokenizer(f)
    ends = ("eos_token_id", "eot_token_id", "eom_token_id")
    eos = [
        int(f.get(f"tokenizer.ggml.{k}")) for k in ends if f.get(f"tokenizer.ggml.{k}") is not None
    ]
    bos = f.get("tokenizer.ggml.bos_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    default_bos = f.get("tokenizer.ggml.model") == "llama"
    template = f.get("tokenizer.chat_template")
    tokens = f.get("tokenizer.ggml.tokens")
    specials = {
        name: tokens[int(i)]
        for name, key in zip(_SPECIALS, ("bos", "eos", "unknown", "padding"), strict=True)
        if (i := f.get(f"tokenizer.ggml.{key}_token_id")) is not None and 0 <= int(i) < len(tokens)
    }
    return HfTokenizer(
        tok,
        eos_token_ids=eos,
        bos_token_id=None if bos is None else int(bos),
        add_bos=bool(f.get("tokenizer.ggml.add_bos_token", default_bos)),
        chat_template=template if isinstance(template, str) else None,
        special_tokens=specials,
        where=str(path),
    )


def _from_directory(directory: Path) -> HfTokenizer:
    file = directory / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(
            f"{directory} has no tokenizer.json (tspd reads Hugging Face fast tokenizers; "
            "transformers' AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) writes one)"
        )
    try:
        tok = RustTokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises plain Exception for any parse error
        raise CheckpointError(f"{file} is not a valid tokenizer file: {exc}") from exc
    cfg = _json(directory / "tokenizer_config.json")
    pieces = {name: _token_text(cfg.get(name)) for name in _SPECIALS}
    bos = _piece_id(tok, pieces["bos_token"], directory)
    eos = [
        *_ids(_json(directory / "config.json").get("eos_token_id")),
        *_ids(_json(directory / "generation_config.json").get("eos_token_id")),
    ]
    eos_piece = _piece_id(tok, pieces["eos_token"], directory)
    eos += [] if eos_piece is None else [eos_piece]
    if bos is None:
        bos = next(iter(_ids(_json(directory / "config.json").get("bos_token_id"))), None)
    add_bos = cfg.get("add_bos_token")
    if not isinstance(add_bos, bool):  # not stated: whatever tokenizer.json's post-processor does
        add_bos = bos is not None and tok.encode("", add_special_tokens=True).ids[:1] == [bos]
    return HfTokenizer(
        tok,
        eos_token_ids=eos,
        bos_token_id=bos,
        add_bos=add_bos,
        chat_template=_template(directory, cfg),
        special_tokens={k: v for k, v in pieces.items() if v is not None},
        where=str(directory),
    )


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return raw


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _piece_id(tok: RustTokenizer, piece: str | None, directory: Path) -> int | None:
    if piece is None:
        return None
    found = tok.token_to_id(piece)
    if found is None:
        raise CheckpointError(f"{directory}: special token {piece!r} is not in tokenizer.json")
    return int(found)


def _ids(value: Any) -> list[int]:
    if isinstance(value, list):
        return [int(v) for v in value]
    return [] if value is None else [int(value)]


def _template(directory: Path, cfg: dict[str, Any]) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    raw = cfg.get("chat_template")
    if isinstance(raw, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        raw = named.get("default")
    if raw is not None and not isinstance(raw, str):
        raise ConfigError(f"{directory}/tokenizer_config.json: chat_template must be a string")
    return raw
