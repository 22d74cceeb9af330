"""What a front door needs from a tokenizer, and the byte tokenizer of the seeded test model.

:class:`Tokenizer` is the interface the node endpoint and the router use: encode a prompt
(with the BOS the model wants), decode ids (special tokens skipped), the ids that end a
generation (a model may have several EOS ids), a chat prompt from OpenAI messages through
the model's chat template (rendered, :class:`ChatText`, then encoded, so the router can
measure the text between the two), and the most bytes of text one token stands for (what
lets the router refuse a prompt that cannot fit the context before tokenizing it). A real
model's is :class:`~tspd_serving.hf_tokenizer.HfTokenizer` (``tokenizer.json`` or a
GGUF's vocabulary; :func:`~tspd_serving.hf_tokenizer.load_tokenizer`).

Special tokens in message content (:class:`ContentSpecials`): by default the rendered text is
encoded whole, so content that spells ``<|im_end|>`` becomes that control token, as Hugging
Face's ``apply_chat_template`` does (a user can then forge turns); ``TEXT`` encodes what the
content spells as plain text while the template's own markup still yields its control tokens.

:class:`ByteTokenizer` serves the seeded model: one token per UTF-8 byte, plus three specials.
Ids 0..255 are the bytes themselves; 256 = BOS, 257 = EOS, 258 = PAD. Decoding drops the
specials and replaces invalid UTF-8 (a generation may stop inside a multi-byte character). Its
chat format is tspd's own plain one (:data:`BYTE_CHAT_TEMPLATE`), since the seeded model was
never trained on any.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from tspd_serving.chat_template import ChatTemplate, Message
from tspd_serving.errors import RequestError

#: The largest token id any front door accepts: ids travel as int32 into the engine's arrays,
#: so anything above is refused before a conversion could overflow (the vocabulary check
#: proper is the engine's, or the router's when it knows the model's vocabulary).
MAX_TOKEN_ID = 2**31 - 1
BYTE_VOCAB_SIZE = 259
#: The byte model's chat format: one ``<|role|>content`` line per message, then the prompt.
BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class ContentSpecials(StrEnum):
    """How special-token text inside chat message content is encoded."""

    PARSE = "parse"  #: as the special tokens it spells (Hugging Face's default)
    TEXT = "text"  #: as plain text; only the template's markup yields special tokens


@dataclass(frozen=True, slots=True)
class ChatText:
    """A conversation rendered by the chat template, cut where message content spelled a
    special token that must stay text (:attr:`ContentSpecials.TEXT`): ``parts[0::2]`` are
    encoded as usual (the template's markup yields its special tokens), ``parts[1::2]``, what
    the content spelled, as plain text. Encoding concatenates the parts' ids in order."""

    parts: tuple[str, ...]

    @property
    def text(self) -> str:
        """The prompt text as the model reads it."""
        return "".join(self.parts)

    def utf8_bytes(self) -> int:
        return sum(len(p.encode("utf-8", "surrogatepass")) for p in self.parts)


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

    @property
    def max_token_bytes(self) -> int | None:
        """The most bytes of input text one token stands for (special tokens' text
        included). None when no such bound holds (a normalizer that drops characters, an
        unknown-token id that swallows a whole word)."""
        ...

    def least_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text, add_bos=False))``, found without tokenizing:
        the text's bytes over :attr:`max_token_bytes`, less characters the tokenizer drops
        (0 when there is no bound)."""
        ...

    def chat_text(
        self, messages: Sequence[Message], content: ContentSpecials = ContentSpecials.PARSE
    ) -> ChatText:
        """A conversation through the chat template, ready for the assistant's answer
        (raises :class:`~tspd_serving.errors.TemplateError`)."""
        ...

    def chat_ids(self, chat: ChatText) -> list[int]:
        """The prompt ids of a rendered conversation (the BOS the template does not write
        itself, if the model wants one)."""
        ...

    def chat_prompt(self, messages: Sequence[Message]) -> list[int]:
        """``chat_ids(chat_text(messages))``."""
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

    @property
    def max_token_bytes(self) -> int:
        return 1

    def least_tokens(self, text: str) -> int:
        return len(text.encode("utf-8", "surrogatepass"))

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

    def chat_text(
        self, messages: Sequence[Message], content: ContentSpecials = ContentSpecials.PARSE
    ) -> ChatText:
        """The plain format's text (no text spells a special token here: ``content`` does
        not matter)."""
        return ChatText((self.render_chat(messages),))

    def chat_ids(self, chat: ChatText) -> list[int]:
        """BOS, then the text's bytes (the template cannot spell BOS as text)."""
        return self.encode(chat.text)

    def chat_prompt(self, messages: Sequence[Message]) -> list[int]:
        return self.chat_ids(self.chat_text(messages))
