"""The producer-step counter of a P rank (wire.md §7): the forward advances it, the worker reads it.

Layerwise streaming sends a prefill chunk's KV an interval of producer steps at a time, as the
forward writes it. The forward says how far it got by advancing a counter once per finished
producer step; the transfer worker, another process, reads it without touching the device::

    engine process                                        transfer worker process
    ───────────────────────────────────────────           ──────────────────────────────────
    arm_layerwise: begin = reserve(S)  (host int)          CounterReader.value()
    forward, after each producer step's KV writes:         Pacer: ready(value, begin+e-1)?
      CPU : host[0] += 1         ── shared memory ──────►    -> post the interval's writes
      CUDA: dev += 1 ; host[0] <- dev (async copy on the
            forward's stream into pinned host memory) ──►

Values live modulo ``M = 2**62``; ``ready(c, t)`` — "the counter ``c`` has passed ``t``" — is
``c != t and (t - c) mod M > M/2``, so comparisons stay right across the wrap. The device
counter itself is an int64 that is only ever incremented; readers reduce it mod M (two's
complement keeps that right even past 2**63).

Ownership: the engine process owns :class:`StepCounter` (``reserve`` on the forward thread,
``advance`` wherever the forward runs; the reserve/issue check makes a forward that steps without
being armed an error instead of an early send). The worker only reads, through
:class:`CounterReader`; :class:`Pacer` is the worker thread that turns "counter passed target"
into callbacks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from tspd_core.pd.errors import ConfigError, UsageError
from tspd_core.procname import name_this_thread

log = logging.getLogger(__name__)

M = 1 << 62  #: counter modulus (wire.md §7)
MASK = M - 1
HALF = M // 2

#: Pacer polling: start fine (a layer of a GPU forward takes ~0.1-5 ms), back off to this.
POLL_MIN_S = 50e-6
POLL_MAX_S = 1e-3
#: While the nearest target is more than one step away, the pacer sleeps this share of the
#: time the counter needs to get there at its last pace (at most :data:`PACE_SLEEP_MAX_S`)
#: instead of polling every millisecond: a whole CPU forward in one interval would otherwise
#: wake each worker ~1,000 times a second for nothing, on the cores the forward needs.
PACE_SHARE = 0.5
PACE_SLEEP_MAX_S = 10e-3
#: A move slower than this per step is a gap between forwards, not the forward's pace.
PACE_GAP_S = 0.25


def wrap(value: int) -> int:
    """``value`` mod M."""
    return value & MASK


def ready(counter: int, target: int) -> bool:
    """wire.md §7: the counter has passed ``target`` (wrap-safe)."""
    c, t = counter & MASK, target & MASK
    return c != t and ((t - c) & MASK) > HALF


def steps_to_pass(counter: int, target: int) -> int:
    """How many more steps the counter needs to pass ``target``: 0 once it has."""
    return 0 if ready(counter, target) else ((target - counter) & MASK) + 1


def behind(a: int, b: int) -> int:
    """How many steps ``a`` is behind ``b`` (negative when ahead), wrap-safe within M/2."""
    d = (b - a) & MASK
    return d - M if d > HALF else d


class StepCounter:
    """One P rank's producer-step counter (engine side).

    ``device``: where the forward runs. On CPU the counter is an int64 in shared memory that
    :meth:`advance` stores to after the step's KV writes. On CUDA it is a device int64 that
    :meth:`advance` increments on the current stream, followed by an asynchronous copy into
    the shared host mirror, which is page-locked (``cudaHostRegister``) so the copy is a DMA
    that lands when the stream reaches it — after the step's kernels — with no host sync.

    ``start`` is the initial value (tests start near the wrap).
    """

    def __init__(self, device: torch.device | str = "cpu", start: int = 0) -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"a step counter runs on cpu or cuda, not {self.device}")
        start = wrap(int(start))
        host = torch.full((1,), start, dtype=torch.int64)
        host.share_memory_()  # type: ignore[no-untyped-call]
        self.host = host  #: the shared host word the transfer worker maps
        self._np = host.numpy()
        self._lock = threading.Lock()
        self._reserved = start  # begin of the next armed forward
        self._issued = start  # steps the forward has issued (CPU: done; CUDA: enqueued)
        self._dev: torch.Tensor | None = None
        self._pinned = False
        if self.device.type == "cuda":
            self._dev = torch.full((1,), start, dtype=torch.int64, device=self.device)
            self._pin()

    def _pin(self) -> None:
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        err = cudart.cudaHostRegister(self.host.data_ptr(), self.host.element_size(), 0)
        if int(err) != 0:
            raise ConfigError(f"cannot page-lock the step counter's host word (cuda error {err})")
        self._pinned = True

    # ---- the forward ----------------------------------------------------------------------

    def advance(self, steps: int = 1) -> None:
        """The forward finished ``steps`` producer steps (call after their KV writes)."""
        if steps < 0:
            raise UsageError(f"a step counter only moves forward, not by {steps}")
        if self._dev is not None:
            self._dev.add_(steps)
            self.host.copy_(self._dev, non_blocking=True)
        else:
            # One aligned 8-byte store: the worker never sees a torn value.
            self._np[0] = np.int64(wrap(int(self._np[0]) + steps))
        self._issued = wrap(self._issued + steps)

    # ---- the outbox ---------------------------------------------------------------------

    def reserve(self, steps: int) -> int:
        """Reserve the next forward's ``steps``; returns ``begin`` (the value before them).

        :class:`UsageError` (nothing reserved beyond a resync) if the forward has issued more
        steps than were ever reserved: a forward advanced the counter without being armed, so
        the intervals of a later forward would pass too early.
        """
        with self._lock:
            try:
                self.check()
            except UsageError:
                self._reserved = self._issued  # resync, so the next forward lines up again
                raise
            begin = self._reserved
            self._reserved = wrap(begin + steps)
            return begin

    def check(self) -> None:
        """:class:`UsageError` if the forward issued steps nobody reserved (see reserve)."""
        over = behind(self._reserved, self._issued)
        if over > 0:
            raise UsageError(
                f"the step counter was advanced {over} step(s) beyond what was reserved: "
                "call arm_layerwise before every forward that advances it"
            )

    @property
    def reserved(self) -> int:
        return self._reserved

    @property
    def issued(self) -> int:
        return self._issued

    def value(self) -> int:
        """The counter as the worker sees it now (the host mirror; no device sync)."""
        return wrap(int(self._np[0]))

    def close(self) -> None:
        """Release the page lock (CUDA); the shared word stays valid for the worker."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())  # type: ignore[no-untyped-call]
            self._pinned = False


class CounterReader:
    """The worker's read-only view of a :class:`StepCounter`'s shared host word."""

    def __init__(self, host: torch.Tensor) -> None:
        if host.dtype != torch.int64 or host.numel() != 1 or host.device.type != "cpu":
            raise ConfigError("a step counter is one int64 in host memory")
        self._host = host  # keep the shared mapping alive
        self._np = host.numpy()

    def value(self) -> int:
        return wrap(int(self._np[0]))


Fire = Callable[[], None]


class Pacer:
    """A worker thread that waits for counter targets and fires a callback for each passed one.

    ``wait(key, target, fire)`` registers (any thread); ``fire`` runs on the pacer thread once
    ``ready(counter, target)`` holds, so it must only hand work over (``TransferWorker.post``).
    ``discard(key)`` drops a wait that has not fired. The thread polls only while waits exist,
    every 50 µs at first, backing off to 1 ms while nothing passes; once it has seen the
    counter move (its pace: seconds per step, averaged), a target more than one step away is
    slept towards instead — :data:`PACE_SHARE` of the time the remaining steps take at that
    pace, at most :data:`PACE_SLEEP_MAX_S` — so the fine polling covers about the last step.
    """

    def __init__(self, reader: CounterReader, name: str = "tspd-layerwise-pacer") -> None:
        self._reader = reader
        self._waits: dict[object, tuple[int, Fire]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._kick = False
        self._pace = _Pace()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def wait(self, key: object, target: int, fire: Fire) -> None:
        with self._cond:
            self._waits[key] = (wrap(target), fire)
            self._kick = True  # a new wait: poll finely again
            self._cond.notify()

    def discard(self, key: object) -> None:
        with self._cond:
            self._waits.pop(key, None)

    def waiting(self) -> int:
        with self._cond:
            return len(self._waits)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _serve(self) -> None:
        name_this_thread()
        pause = POLL_MIN_S
        while True:
            with self._cond:
                while not self._waits and not self._closed:
                    self._pace.idle()
                    self._cond.wait()
                    pause = POLL_MIN_S
                if self._closed:
                    return
                if self._kick:
                    self._kick, pause = False, POLL_MIN_S
                value = self._reader.value()
                due = [k for k, (t, _) in self._waits.items() if ready(value, t)]
                fired = [self._waits.pop(k)[1] for k in due]
                ahead = min((steps_to_pass(value, t) for t, _ in self._waits.values()), default=0)
            self._pace.saw(value, time.monotonic())
            for fire in fired:
                try:
                    fire()
                except Exception:  # a broken callback must not stop the pacing of other rooms
                    log.exception("layerwise pacer callback failed")
            if fired:
                pause = POLL_MIN_S
                continue
            far = self._pace.sleep_for(ahead)
            if far > pause:
                time.sleep(far)  # (a new wait does not cut it short: it is at most 10 ms)
                continue
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)


class _Pace:
    """The counter's pace as the pacer sees it (its thread only): seconds per step, averaged
    over the moves it saw, a gap between forwards left out."""

    def __init__(self) -> None:
        self.per_step: float | None = None
        self._last: tuple[int, float] | None = None

    def idle(self) -> None:
        """No wait: the next move may come after a gap, which is no pace."""
        self._last = None

    def saw(self, value: int, now: float) -> None:
        last = self._last
        if last is not None and last[0] == value:
            return
        self._last = (value, now)
        if last is None:
            return
        moved = (value - last[0]) & MASK
        each = (now - last[1]) / moved
        if moved < HALF and each < PACE_GAP_S:
            self.per_step = each if self.per_step is None else 0.5 * (self.per_step + each)

    def sleep_for(self, ahead: int) -> float:
        """How long to sleep when the nearest target is ``ahead`` steps away (0: poll)."""
        if ahead <= 1 or self.per_step is None:
            return 0.0
        return min(PACE_SLEEP_MAX_S, PACE_SHARE * (ahead - 1) * self.per_step)
