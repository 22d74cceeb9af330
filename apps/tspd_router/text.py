"""Token ids to text, chunk by chunk, and OpenAI ``stop`` strings over the streamed text.

The byte tokenizer emits one UTF-8 byte per token, so a character may span chunks: the
incremental decoder holds an incomplete sequence back until its last byte arrives. A stop
string may span chunks too: :class:`StopMatcher` holds back the longest tail that could still
grow into one, and cuts the text before the first stop string found (it is not returned,
as in OpenAI's API).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence

BYTES = 256  # ids below are bytes; the rest (BOS, EOS, PAD) carry no text


class Detokenizer:
    """Incremental byte-token decoder (invalid UTF-8 becomes U+FFFD, as the engine's)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Iterable[int]) -> str:
        return self._decoder.decode(bytes(i for i in ids if 0 <= i < BYTES))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Finds the first of ``stops`` in the text fed so far; ``stopped`` once found."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that is safe to emit now (never part of a stop string)."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
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
