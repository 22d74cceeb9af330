"""Writes to one Mooncake session through a bounded window, in pushes that complete in order.

Mooncake's synchronous batch call waits for completion by polling the batch's status in a loop
that never sleeps, so each writing thread keeps a core busy for the whole transfer — on a
2-core host that is a core taken from the TCP lanes doing the copying (two P workers
re-slicing into one D spun both cores). Over TCP a stream therefore submits each descriptor
asynchronously, keeps a bounded window of them in flight, and polls the oldest with short naps
(a few µs of CPU per check)::

    push(piece 0) push(piece 1) ...                      (each push: descriptors + a callback)
    submit d0 d1 ... d63 │ poll d0: spin 50 µs, then naps ≤ 0.5 ms ─ done ─► submit d64 ...
           └── window: ≤ 64 descriptors and ≤ 16 MiB in flight ──┘
    piece 0's last descriptor done ─► piece 0's callback (e.g. "scatter slot k") ─► ...

Pushes share the window, so a staged transfer keeps writing its next piece while the previous
one drains, instead of emptying the pipe at every piece. With ``window`` 0 a push is
Mooncake's synchronous batch call (RDMA, where completions come back in microseconds).

Ownership: one thread owns a stream. After a failure (a descriptor refused or failed, a
timeout, ``cancel``) the stream submits nothing more, waits for what is in flight and raises
:class:`TransferError`; no callback fires after the failure. So when a stream raises, none of
its descriptors is still in flight (except after a timeout, which is logged).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from tspd_core.pd.errors import TransferError

log = logging.getLogger(__name__)

U64 = npt.NDArray[np.uint64]
#: Bytes in flight per stream: a cancelled write drains at most this much (~10 ms over TCP).
WINDOW_BYTES = 16 << 20
#: Polling a descriptor: busy for this long first (small writes land in ~0.1 ms), then naps of
#: an eighth of the time waited so far, within these bounds.
SPIN_S, MIN_NAP_S, MAX_NAP_S = 50e-6, 20e-6, 500e-6


class WriteStream:
    """One thread's writes to ``session`` (see the module docstring)."""

    def __init__(
        self,
        raw: Any,
        session: str,
        window: int,
        max_batch: int,
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> None:
        self._raw = raw  # mooncake.engine.TransferEngine
        self.session = session
        self._window, self._max_batch, self._timeout_s = window, max_batch, timeout_s
        self._cancel = cancel
        # In flight, oldest first: (index, batch id, bytes, the push's callback if it is the
        # push's last descriptor).
        self._flight: deque[tuple[int, int, int, Callable[[], None] | None]] = deque()
        self._bytes = 0
        self.pushed = 0  #: descriptors handed to the stream so far
        self.submitted = 0  #: descriptors handed to Mooncake so far
        self._error: str | None = None

    @property
    def in_flight(self) -> int:
        return len(self._flight)

    def push(
        self, src: U64, dst: U64, lengths: U64, done: Callable[[], None] | None = None
    ) -> None:
        """Write these descriptors after those pushed before; ``done()`` runs (on this thread,
        inside a later call) once all of them landed. Blocks while the window is full."""
        self._raise_if_failed()
        first, self.pushed = self.pushed, self.pushed + len(src)
        if not self._window:
            self._push_batches(first, src, dst, lengths)
            if done is not None:
                self._call(done)
            return
        s, d, n = src.tolist(), dst.tolist(), lengths.tolist()
        for i, (a, b, k) in enumerate(zip(s, d, n, strict=True)):
            while self._flight and (
                len(self._flight) >= self._window or self._bytes + k > WINDOW_BYTES
            ):
                self.reap()
            self._submit(first + i, a, b, k, done if i == len(s) - 1 else None)
        if not s and done is not None:  # nothing to write: done once the earlier pushes are
            if self._flight:
                self._flight.append((first, 0, 0, done))
            else:
                done()

    def reap(self) -> bool:
        """Wait for the oldest descriptor in flight (running its push's callback if it was the
        last); False when nothing is in flight. Raises once the stream failed (drained)."""
        if not self._flight:
            self._raise_if_failed()
            return False
        index, batch, nbytes, done = self._flight.popleft()
        self._bytes -= nbytes
        self._settled(index, self._wait(batch, nbytes) if batch else 1, nbytes, done)
        return True

    def settle(self, timeout_s: float) -> bool:
        """Reap what lands within ``timeout_s``: True once nothing is in flight, False when
        something still is (the stream stays usable, by this thread or the next owner)."""
        until = time.perf_counter() + timeout_s
        while self._flight:
            index, batch, nbytes, done = self._flight[0]
            rc = self._wait(batch, nbytes, until) if batch else 1
            if rc == 0:
                return False
            self._flight.popleft()
            self._bytes -= nbytes
            self._settled(index, rc, nbytes, done)
        self._raise_if_failed()
        return True

    def finish(self) -> None:
        """Wait until everything pushed landed; :class:`TransferError` if anything failed."""
        while self.reap():
            pass

    # ---- internals ----------------------------------------------------------------------

    def _submit(
        self, index: int, src: int, dst: int, n: int, done: Callable[[], None] | None
    ) -> None:
        if self._cancel is not None and self._cancel.is_set():
            self._fail(
                f"write to {self.session} cancelled after {index} of {self.pushed} descriptors"
            )
            self._raise_if_failed()
        batch = int(self._raw.transfer_submit_write(self.session, src, dst, n))
        if not 0 < batch < 1 << 63:  # 0 or a negative code: nothing was submitted
            self._fail(self._failed("submit refused", index, index, n))
            self._raise_if_failed()
        self._flight.append((index, batch, n, done))
        self._bytes += n
        self.submitted += 1

    def _settled(self, index: int, rc: int, nbytes: int, done: Callable[[], None] | None) -> None:
        if rc != 1:
            why = "timed out" if rc == -2 else f"rc {rc}"
            self._fail(self._failed(why, index, index, nbytes))
        if done is not None and self._error is None:
            self._call(done)
        self._raise_if_failed()

    def _call(self, done: Callable[[], None]) -> None:
        try:
            done()
        except BaseException:
            self._fail("a completion callback failed")
            self._drain()
            raise

    def _push_batches(self, first: int, src: U64, dst: U64, lengths: U64) -> None:
        for start in range(0, len(src), self._max_batch):
            if self._cancel is not None and self._cancel.is_set():
                self._error = (
                    f"write to {self.session} cancelled after {first + start} of "
                    f"{self.pushed} descriptors"
                )
                self._raise_if_failed()
            end = min(start + self._max_batch, len(src))
            rc = self._raw.batch_transfer_sync_write(
                self.session,
                src[start:end].tolist(),
                dst[start:end].tolist(),
                lengths[start:end].tolist(),
            )
            if rc != 0:
                nbytes = int(lengths[start:end].sum())
                self._error = self._failed(f"rc {rc}", first + start, first + end - 1, nbytes)
                self._raise_if_failed()
            self.submitted += end - start

    def _fail(self, why: str) -> None:
        if self._error is None:
            self._error = why

    def _raise_if_failed(self) -> None:
        """After a failure: wait for everything in flight, then raise."""
        if self._error is None:
            return
        self._drain()
        raise TransferError(self._error)

    def _drain(self) -> None:
        while self._flight:
            _, batch, nbytes, _ = self._flight.popleft()
            if batch:
                self._wait(batch, nbytes)
        self._bytes = 0

    def _failed(self, why: str, first: int, last: int, nbytes: int) -> str:
        return (
            f"Mooncake write to {self.session} failed ({why}) on descriptors {first}..{last} "
            f"of {self.pushed} ({nbytes} bytes)"
        )

    def _wait(self, batch: int, nbytes: int, until: float | None = None) -> int:
        """Mooncake's status of a one-descriptor batch once it is final: 1 done, -1 failed,
        -2 timed out (the batch is then left to Mooncake: it may still land); 0 when it is
        still pending at ``until``."""
        started = time.perf_counter()
        deadline = started + self._timeout_s + nbytes / 1e9
        while True:
            rc = int(self._raw.transfer_check_status(batch))
            if rc != 0:
                return rc
            now = time.perf_counter()
            if until is not None and now >= until:
                return 0
            if now > deadline:
                log.error(
                    "a Mooncake write of %d bytes is not done after %.1f s", nbytes, now - started
                )
                return -2
            waited = now - started
            if waited > SPIN_S:
                time.sleep(min(MAX_NAP_S, max(MIN_NAP_S, waited / 8)))
