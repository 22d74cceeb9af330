"""Device token feed: what an engine loop needs to launch decode step N+1 before it has read
step N's tokens on the host.

A fed decode step reads each row's input id *on the device*: from a **feed cell** that the
previous step's argmax wrote (:class:`FromFeed`), or from an id the host supplies
(:class:`FromHost`, e.g. the first token after a prefill). The argmax writes the cells and
starts an async device-to-host copy into a slot of a pinned **host ring**, then records an
**event**; the host reads the slot only once that event has completed, by which time the
device is already running the next step::

    host:   launch N ─ launch N+1 ─ wait ev N, read N, commit N ─ launch N+2 ─ wait ev N+1 ...
    device: [fwd N | argmax N → cells, D2H → slot N, ev N][fwd N+1 (reads cells) | ...]

The contract (:class:`ModelDeviceFeed`) follows TokenSpeed's model-side feed trait; the torch
helpers (:class:`TorchFeedDevice`, :class:`HostRing`) implement its device-agnostic parts for
CPU and for CUDA (streams, ``torch.cuda.Event``, pinned memory). On CPU every torch op is
synchronous, so events are born complete, but the code path is the same.

Threading: a feed device, its ring and its events belong to the one engine thread of a rank.
This is the only tspd_core module besides ``pd`` that imports torch (layout and sched stay
numpy-only).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from tspd_core.errors import TspdError

#: "No id" in a row mask (the device encoding; masks are int64 arrays).
NO_ID: Final = -1
#: Bit marking a host-supplied id in an encoded source word (ids stay below 2**40).
HOST_BIT: Final = 1 << 40

IntArray = npt.NDArray[np.int64]
BatchT = TypeVar("BatchT")
RowT = TypeVar("RowT")


class FeedError(TspdError, RuntimeError):
    """The feed was misused (too many rows, ring overrun) or the model has no device feed."""


@dataclass(frozen=True, slots=True)
class FromFeed:
    """The row's input is the previous step's argmax for row ``row`` (still on the device)."""

    row: int


@dataclass(frozen=True, slots=True)
class FromHost:
    """The row's input is ``token``, known on the host (a prefill's first token, a PD seed)."""

    token: int


FeedSource = FromFeed | FromHost


def encode_sources(sources: Sequence[FeedSource], cells: int) -> IntArray:
    """One int64 word per row: a feed row index, or ``HOST_BIT | token``.

    Raises :class:`FeedError` for a feed row beyond ``cells`` or a negative/huge token.
    """
    on_host = np.array([isinstance(s, FromHost) for s in sources], dtype=bool)
    token = np.array([s.token if isinstance(s, FromHost) else 0 for s in sources], np.int64)
    row = np.array([s.row if isinstance(s, FromFeed) else 0 for s in sources], np.int64)
    return encode_source_columns(on_host, token, row, cells)


def encode_source_columns(
    on_host: npt.NDArray[np.bool_],
    token: npt.NDArray[np.integer],
    feed_row: npt.NDArray[np.integer],
    cells: int,
) -> IntArray:
    """Vectorised :func:`encode_sources` over a round's columns (a scheduler's decode items:
    ``token`` where ``on_host``, else the previous round's ``feed_row``)."""
    tok = token.astype(np.int64)
    row = feed_row.astype(np.int64)
    bad_row = ~on_host & ((row < 0) | (row >= cells))
    if bad_row.any():
        i = int(np.argmax(bad_row))
        raise FeedError(f"row {i}: feed row {row[i]} outside the {cells} feed cells")
    bad_tok = on_host & ((tok < 0) | (tok >= HOST_BIT))
    if bad_tok.any():
        i = int(np.argmax(bad_tok))
        raise FeedError(f"row {i}: host token {tok[i]} is not a valid id")
    return np.where(on_host, HOST_BIT | tok, row)


def row_masks(banned: Sequence[Sequence[int]]) -> IntArray:
    """The ``[rows, 2]`` two-id masks: up to two ids per row that the argmax must not pick."""
    out = np.full((len(banned), 2), NO_ID, dtype=np.int64)
    for i, ids in enumerate(banned):
        if len(ids) > 2:
            raise FeedError(f"row {i}: a row mask holds at most two ids, got {list(ids)}")
        out[i, : len(ids)] = ids
    return out


def to_device(array: npt.NDArray[np.generic], device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without making the host wait for the device.

    A copy from pageable memory blocks the host until the stream reaches it, which would stall
    a launch behind the step still running; on CUDA the array is staged in pinned memory
    (torch's caching host allocator keeps the block alive until the copy is done) and copied
    asynchronously. On CPU this is ``torch.from_numpy`` (no copy).
    """
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def masked_argmax(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Argmax of each row of ``logits`` ``[rows, vocab]`` with the row's mask ids at -inf.

    Ties go to the lowest id (``torch.argmax``); the synchronous loop uses this same function,
    so the fed and synchronous loops pick the same tokens.
    """
    vocab = torch.arange(logits.shape[1], device=logits.device)
    hit = (vocab[None, :] == masks[:, :1]) | (vocab[None, :] == masks[:, 1:2])
    return torch.where(hit, float("-inf"), logits).argmax(dim=1)


@dataclass(slots=True)
class FeedEvent:
    """A marker recorded after a step's readback copy; complete when the copy has landed.

    On CUDA it wraps a ``torch.cuda.Event``; on CPU ops are synchronous, so ``cuda`` is None
    and the event is complete once recorded.
    """

    cuda: torch.cuda.Event | None = None
    recorded: bool = False
    destroyed: bool = False


@dataclass(slots=True)
class HostSlot:
    """One slot of the :class:`HostRing`: pinned cells for one step's ids, and its event."""

    index: int
    cells: torch.Tensor  # [max_rows] int64, pinned on CUDA
    event: FeedEvent
    rows: int = 0
    busy: bool = False


class TorchFeedDevice:
    """Device side of the feed on one torch device: feed cells, events, pinned memory.

    ``cells`` holds the last argmax of every row of the last fed step; ``resolve`` turns
    encoded sources into the input ids of the next step without a host round trip. Owned by
    the engine thread; all work goes on ``stream`` (the current stream on CUDA).
    """

    def __init__(self, device: torch.device, max_rows: int) -> None:
        if max_rows <= 0:
            raise FeedError(f"max_rows must be positive, got {max_rows}")
        self.device = device
        self.max_rows = max_rows
        self.is_cuda = device.type == "cuda"
        self.cells = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.stream = torch.cuda.current_stream(device) if self.is_cuda else None

    def resolve(self, words: IntArray) -> torch.Tensor:
        """Input ids ``[n]`` on the device for encoded source words (see encode_sources)."""
        n = len(words)
        if not 0 < n <= self.max_rows:
            raise FeedError(f"{n} rows, feed capacity {self.max_rows}")
        w = to_device(words, self.device)
        host = (w & HOST_BIT) != 0
        return torch.where(host, w & (HOST_BIT - 1), self.cells[w.clamp(0, self.max_rows - 1)])

    def argmax_to_cells(self, logits: torch.Tensor, masks: IntArray) -> torch.Tensor:
        """Masked argmax of ``logits`` ``[n, vocab]`` into ``cells[:n]``; returns that view."""
        n = logits.shape[0]
        if n != len(masks) or not 0 < n <= self.max_rows:
            raise FeedError(f"{n} logit rows, {len(masks)} masks, capacity {self.max_rows}")
        m = to_device(masks, self.device)
        self.cells[:n] = masked_argmax(logits, m)
        return self.cells[:n]

    def new_event(self) -> FeedEvent:
        cuda = torch.cuda.Event() if self.is_cuda else None  # type: ignore[no-untyped-call]
        return FeedEvent(cuda)

    def record(self, event: FeedEvent) -> None:
        if event.destroyed:
            raise FeedError("record on a destroyed event")
        if event.cuda is not None:
            event.cuda.record(self.stream)
        event.recorded = True

    def query(self, event: FeedEvent) -> bool:
        """Whether the work before ``event`` has completed; never blocks."""
        if not event.recorded:
            raise FeedError("query on an event that was never recorded")
        if event.cuda is None:
            return True
        return bool(event.cuda.query())  # type: ignore[no-untyped-call]

    def synchronize(self, event: FeedEvent) -> None:
        """Block the host until the work before ``event`` has completed."""
        if not event.recorded:
            raise FeedError("synchronize on an event that was never recorded")
        if event.cuda is not None:
            event.cuda.synchronize()

    def destroy(self, event: FeedEvent) -> None:
        event.destroyed = True
        event.cuda = None

    def copy_d2h_async(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Start copying ``src`` (device) into ``dst`` (host, pinned on CUDA); no sync."""
        if dst.device.type != "cpu":
            raise FeedError(f"copy_d2h_async destination must be host memory, got {dst.device}")
        dst.copy_(src, non_blocking=self.is_cuda)

    def alloc_host_pinned(self, nbytes: int) -> torch.Tensor:
        """Zeroed host bytes, page-locked when the device is CUDA (so D2H copies are async)."""
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        return buf.pin_memory() if self.is_cuda else buf

    def free_host_pinned(self, buf: torch.Tensor) -> None:
        # torch frees pinned memory with the last reference; resizing to 0 drops ours now.
        buf.resize_(0)


class HostRing:
    """A ring of pinned host slots, one per fed step in flight.

    ``acquire`` hands out slots round robin; a slot is busy from ``acquire`` until ``read``.
    Acquiring a busy slot is a loop bug (more steps in flight than ``depth``) and raises
    :class:`FeedError` instead of overwriting ids the host has not read.
    """

    def __init__(self, device: TorchFeedDevice, depth: int = 2) -> None:
        if depth <= 0:
            raise FeedError(f"ring depth must be positive, got {depth}")
        self.device = device
        width = device.max_rows
        self._buf = device.alloc_host_pinned(depth * width * 8)
        cells = self._buf.view(torch.int64).view(depth, width)
        self.slots = [HostSlot(i, cells[i], device.new_event()) for i in range(depth)]
        self._next = 0

    def acquire(self, rows: int) -> HostSlot:
        slot = self.slots[self._next]
        if slot.busy:
            raise FeedError(
                f"host ring overrun: slot {slot.index} still holds an unread step "
                f"({len(self.slots)} slots); read a step before launching another"
            )
        if not 0 < rows <= self.device.max_rows:
            raise FeedError(f"{rows} rows, ring width {self.device.max_rows}")
        self._next = (self._next + 1) % len(self.slots)
        slot.busy, slot.rows = True, rows
        slot.event.recorded = False  # reading before this use's record is then an error
        return slot

    def ready(self, slot: HostSlot) -> bool:
        """Whether ``slot``'s ids have landed; never blocks."""
        return self.device.query(slot.event)

    def read(self, slot: HostSlot) -> IntArray:
        """Wait for ``slot``'s event, return a copy of its ids and free the slot."""
        if not slot.busy:
            raise FeedError(f"slot {slot.index} read twice or never acquired")
        self.device.synchronize(slot.event)
        ids = slot.cells[: slot.rows].numpy().copy()
        slot.busy = False
        return ids

    def discard(self, slot: HostSlot) -> None:
        """Free ``slot`` without reading it (its step's results are thrown away, or its
        launch failed before the event was recorded)."""
        if slot.event.recorded:
            self.device.synchronize(slot.event)
        slot.busy = False

    @property
    def in_flight(self) -> int:
        return sum(s.busy for s in self.slots)

    def close(self) -> None:
        for slot in self.slots:
            self.device.destroy(slot.event)
        self.device.free_host_pinned(self._buf)


class ModelDeviceFeed(abc.ABC, Generic[BatchT, RowT]):
    """The model half of the device token feed (after TokenSpeed's model feed trait).

    ``BatchT`` is the engine's decode batch (each row's position and block table; in tspd the
    scheduler's ``DecodeRound``) and ``RowT`` names one row's request for the block methods.
    Defaults say "no feed": ``supports_device_token_feed`` is False and the feed methods raise
    :class:`FeedError`, so a loop must check support before choosing the fed path.

    Ordering: every call is made by the engine thread, in launch order; device work is queued
    on one stream, so a fed step's resolve sees the cells the previous argmax wrote.
    """

    def supports_device_token_feed(self) -> bool:
        """Whether ``decode_batch_fed`` / ``argmax_batch_to_feed`` work for this model."""
        return False

    def decode_batch_fed(self, sources: IntArray, batch: BatchT) -> torch.Tensor:
        """Decode one token per row with the input id read on the device from ``sources``
        (encoded words, see :func:`encode_sources` / :func:`encode_source_columns`).

        Writes the K/V of each row's next position (its page must be reserved) and returns
        the logits ``[rows, vocab]`` (device). It does NOT push the token or advance the
        length: the scheduler does that once the previous step is committed.
        """
        raise FeedError("decode_batch_fed: this model has no device token feed")

    def argmax_batch_to_feed(
        self, logits: torch.Tensor, masks: IntArray, dst: torch.Tensor, event: FeedEvent
    ) -> None:
        """Masked argmax of ``logits`` into the feed cells, async copy to ``dst``, record.

        ``masks`` is ``[rows, 2]`` (see :func:`row_masks`). Never synchronises: ``dst`` (host,
        pinned) is valid once ``event`` completes.
        """
        raise FeedError("argmax_batch_to_feed: this model has no device token feed")

    def reserve_decode_block(self, row: RowT) -> int:
        """Allocate the page for ``row``'s next position if missing; return pages added (0/1).

        Raises when the pool is empty (the loop reserves before launching, so it can wait).
        """
        raise FeedError("reserve_decode_block: this model has no device token feed")

    def release_decode_blocks(self, row: RowT, blocks: int) -> None:
        """Give back the last ``blocks`` pages ``reserve_decode_block`` added, for a step
        whose results were discarded (the row finished in the step before)."""
        raise FeedError("release_decode_blocks: this model has no device token feed")

    def fed_step_settled(self) -> None:
        """A fed step has completed on the device (resources it pinned may be released)."""

    def event_query(self, event: FeedEvent) -> bool:
        """Whether the work recorded against ``event`` has completed; never blocks."""
        return True

    def event_synchronize(self, event: FeedEvent) -> None:
        """Block the host until the work recorded against ``event`` has completed."""

    def destroy_event(self, event: FeedEvent) -> None:
        """Release ``event``; it must not be recorded or queried again."""

    def copy_d2h_async(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Async device-to-host copy; ``dst`` stays unread until the stream passes it."""
        raise FeedError("copy_d2h_async: this model has no device token feed")

    def alloc_host_pinned(self, nbytes: int) -> torch.Tensor:
        """Zeroed page-locked host bytes (for the host ring)."""
        raise FeedError("alloc_host_pinned: this model has no device token feed")

    def free_host_pinned(self, buf: torch.Tensor) -> None:
        raise FeedError("free_host_pinned: this model has no device token feed")


class TorchModelFeed(ModelDeviceFeed[BatchT, RowT]):
    """:class:`ModelDeviceFeed` with every device-agnostic method implemented over a
    :class:`TorchFeedDevice`; a model supplies ``decode_batch_fed`` and the block methods."""

    def __init__(self, feed_device: TorchFeedDevice) -> None:
        self.feed_device = feed_device
        self.fed_in_flight = 0

    def supports_device_token_feed(self) -> bool:
        return True

    def argmax_batch_to_feed(
        self, logits: torch.Tensor, masks: IntArray, dst: torch.Tensor, event: FeedEvent
    ) -> None:
        ids = self.feed_device.argmax_to_cells(logits, masks)
        self.feed_device.copy_d2h_async(ids, dst[: len(ids)])
        self.feed_device.record(event)

    def fed_step_settled(self) -> None:
        if self.fed_in_flight <= 0:
            raise FeedError("fed_step_settled without a fed step in flight")
        self.fed_in_flight -= 1

    def event_query(self, event: FeedEvent) -> bool:
        return self.feed_device.query(event)

    def event_synchronize(self, event: FeedEvent) -> None:
        self.feed_device.synchronize(event)

    def destroy_event(self, event: FeedEvent) -> None:
        self.feed_device.destroy(event)

    def copy_d2h_async(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.feed_device.copy_d2h_async(src, dst)

    def alloc_host_pinned(self, nbytes: int) -> torch.Tensor:
        return self.feed_device.alloc_host_pinned(nbytes)

    def free_host_pinned(self, buf: torch.Tensor) -> None:
        self.feed_device.free_host_pinned(buf)
