"""Token ids to text, chunk by chunk, and OpenAI ``stop`` strings over the streamed text.

:class:`Detokenizer` decodes a growing sequence incrementally with two offsets, as the
serving engines do: ``prefix`` marks the tokens already turned into text that are kept as
context, ``read`` the end of what was emitted. After new tokens it decodes
``ids[prefix:]`` and emits what extends the text of ``ids[prefix:read]``, unless that text
ends in U+FFFD: then a character is still incomplete (a byte-level BPE token, or a
SentencePiece ``<0xNN>`` byte, may hold half of one) and the tokens wait for the next ones.
Decoding from ``prefix`` rather than from the new token alone gives tokenizers that look at
their neighbours (SentencePiece drops the space that starts a sequence) the text a whole
decode would give. The complete characters before a held-back tail go out at once (``é`` of
``é☃`` while the snowman's bytes arrive). So no chunk holds half a character or text a later
token changes, and the chunks of a stream join to the one-shot decode of the whole output.
The prompt's last tokens seed the context, so a first token that starts with a space keeps it.

A stop string may span chunks too: :class:`StopMatcher` holds back the longest tail that could
still grow into one, and cuts the text before the first stop string found (it is not returned,
as in OpenAI's API). :class:`TextStream` puts the two together for one generation: pieces of
token ids in, text and how it ended out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tspd_serving.errors import RequestError
from tspd_serving.tokenizer import ByteTokenizer, Tokenizer

#: Prompt tokens decoded as context before the first generated one.
CONTEXT_TOKENS = 4
REPLACEMENT = "\ufffd"


class Detokenizer:
    """Incremental decoder of one generation (see the module docstring). Not thread-safe."""

    def __init__(self, tokenizer: Tokenizer | None = None, prompt: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer or ByteTokenizer()
        context = list(prompt[-CONTEXT_TOKENS:])
        try:
            if self.tokenizer.decode(context).endswith(REPLACEMENT):
                context = []  # the prompt ends inside a character: no clean boundary here
        except RequestError:
            context = []  # ids outside the vocabulary: the nodes refuse this prompt
        self._ids = context
        self._prefix = 0
        self._read = len(context)
        self._sent = 0  # characters after ``read``'s text already emitted (held-back tails)

    def feed(self, ids: Iterable[int]) -> str:
        """The text the new ``ids`` complete (may be empty while a character is split)."""
        self._ids.extend(ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """What is still held back (an incomplete character at the end becomes U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        done = self.tokenizer.decode(self._ids[self._prefix : self._read])
        new = self.tokenizer.decode(self._ids[self._prefix :])[len(done) :]
        stable = new if final else new.rstrip(REPLACEMENT)
        out = stable[self._sent :]
        if len(stable) == len(new):  # nothing held back: the window moves on
            self._prefix, self._read, self._sent = self._read, len(self._ids), 0
        else:
            self._sent = max(self._sent, len(stable))
        return out


class StopMatcher:
    """Finds the first of ``stops`` in the text fed so far; ``stopped`` once found."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  #: the stop string found, once ``stopped``

    def feed(self, text: str) -> str:
        """The text that is safe to emit now (never part of a stop string)."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        found = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if found:
            cut, self.matched = min(found)
            self.stopped, self._held = True, ""
            return buf[:cut]
        keep = self._tail(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The end of the stream: what was held back was not a stop string after all."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best


#: An engine's finish reasons in OpenAI's words (a matched stop string is "stop" too).
FINISH = {"eos": "stop", "length": "length"}


@dataclass(frozen=True, slots=True)
class Step:
    """What one piece of tokens adds: its text (possibly empty) and, on the last piece, how
    the generation ended (OpenAI's ``finish_reason``; ``stop_string`` names a matched stop
    string)."""

    text: str
    finish: str | None = None
    stop_string: str | None = None


class TextStream:
    """One generation's token pieces to text (:class:`Detokenizer`) cut at stop strings
    (:class:`StopMatcher`). Not thread-safe."""

    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int], stops: Sequence[str]) -> None:
        self._detok = Detokenizer(tokenizer, prompt)
        self._stops = StopMatcher(stops)

    def feed(self, tokens: Sequence[int], finish: str | None) -> Step:
        """The text ``tokens`` complete; ``finish`` is the engine's reason on its last piece
        (``eos``, ``length``; anything else is passed on as it is). A step with a finish is
        the last: a matched stop string ends the generation early (abort the engine's
        request then)."""
        stops = self._stops
        text = stops.feed(self._detok.feed(tokens))
        if not stops.stopped and finish is not None:
            text += stops.feed(self._detok.flush())
            text += stops.flush()
        if stops.stopped:
            return Step(text, "stop", stops.matched)
        return Step(text, None if finish is None else FINISH.get(finish, finish))
