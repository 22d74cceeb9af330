"""A real model's tokenizer: the ``tokenizers`` library, with its config and chat template.

:func:`load_tokenizer` reads it from where the weights came from:

* a directory: ``tokenizer.json``, plus ``tokenizer_config.json`` (``bos_token``,
  ``eos_token``, ``add_bos_token``, ``chat_template``), ``generation_config.json`` and
  ``config.json`` (their ``eos_token_id``, one or a list: Llama 3 Instruct ends a turn with
  ``<|eot_id|>``, which is not ``config.json``'s EOS) and ``chat_template.jinja``;
* a GGUF file: :func:`~tspd_engine.model.gguf_vocab.gguf_tokenizer`, BOS/EOS (and
  llama.cpp's other end-of-generation ids, EOT and EOM) from ``tokenizer.ggml.*``, the
  template from ``tokenizer.chat_template``;
* nothing (the seeded model): the :class:`ByteTokenizer`.

Missing or corrupt files are refused at start with one line naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as RustTokenizer

from tspd_engine.errors import CheckpointError, ConfigError, RequestError, TemplateError
from tspd_engine.model.chat_template import ChatTemplate, Message
from tspd_engine.model.gguf_file import open_gguf
from tspd_engine.model.gguf_vocab import gguf_tokenizer
from tspd_engine.model.source import is_gguf
from tspd_engine.model.tokenizer import ByteTokenizer, Tokenizer

_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")


class HfTokenizer:
    """A ``tokenizers.Tokenizer`` with the model's BOS/EOS rules and chat template.
    Immutable after construction; ``tokenizers`` encodes and decodes thread-safely."""

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

    def _piece(self, i: int | None) -> str:
        return "" if i is None else (self._tok.id_to_token(i) or "")

    @property
    def eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise RequestError(f"token id {i} outside the vocabulary 0..{self.vocab_size - 1}")
        text: str = self._tok.decode(list(ids), skip_special_tokens=True)
        return text

    def chat_prompt(self, messages: Sequence[Message]) -> list[int]:
        if self.template is None:
            raise TemplateError(
                "this model has no chat template (use /v1/completions, or a model that has one)"
            )
        # The template writes the special tokens it wants (BOS included), as transformers'
        # apply_chat_template: the text is not given another BOS.
        return self.encode(self.template.render(messages), add_bos=False)


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
