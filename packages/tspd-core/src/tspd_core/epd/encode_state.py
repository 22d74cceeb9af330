"""The encode rank's bookkeeping for one room, and the checks before it writes (wire.md §2.5).

Owned by the encode worker's control thread (no locks). A room collects one item info per
prefill session and, from the engine, the chunk (the item's rows in the send buffer). Once it
has the chunk and ``required_dst_info_num`` infos, :func:`check_fanout` validates the whole set
and :func:`plan_writes` turns each receiver's rows into Mooncake descriptors::

    item infos ──┐                       ┌─► check_fanout ─► plan_writes ─► writes ─► Success
                 ├─► all receivers in? ──┤                                      (each receiver)
    chunk ───────┘      no: park (120 s) └─► reaper: Failed to the receivers that did register
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from tspd_core.epd.wire import ItemInfo
from tspd_core.ids import Room
from tspd_core.pd.status import TransferPoll

U64 = npt.NDArray[np.uint64]


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """One item's rows in the encode rank's send buffer (offsets from the buffer's base)."""

    room: Room
    offset: int  #: first byte of the ``[n_tokens, hidden]`` rows
    n_tokens: int
    hidden: int
    dtype: str  #: wire name, e.g. ``torch.bfloat16``
    nbytes: int  #: bytes of the main rows
    deepstack_offset: int = 0
    deepstack_nbytes: int = 0  #: 0 = the item has no deepstack part

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.n_tokens

    @property
    def deepstack_row_bytes(self) -> int:
        return self.deepstack_nbytes // self.n_tokens


@dataclass(slots=True)
class ERoom:
    """One room on an encode rank, from its first info or its chunk to its verdict."""

    room: Room
    created: float
    infos: dict[str, ItemInfo] = field(default_factory=dict)  #: session -> its latest info
    chunk: ChunkMeta | None = None
    chunk_at: float = 0.0
    parked: bool = False  #: the chunk had to wait for receivers
    pending: int = 0  #: writes in flight
    nbytes: int = 0  #: bytes written so far
    status: TransferPoll = TransferPoll.BOOTSTRAPPING
    reason: str = ""
    reported: bool = False  #: the engine was told the chunk's verdict
    cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def required(self) -> int | None:
        """How many receivers this room waits for (any info says; None before the first)."""
        for info in self.infos.values():
            return info.required_dst_info_num
        return None

    @property
    def complete(self) -> bool:
        need = self.required
        return need is not None and len(self.infos) >= need

    @property
    def concluded(self) -> bool:
        return self.status.is_final and self.pending == 0


def check_fanout(infos: list[ItemInfo], chunk: ChunkMeta) -> str | None:
    """Why the receivers' frames and the chunk disagree, or None when the room may be sent.

    Per frame: hidden and dtype equal the chunk's, span equals its rows, the rows are in range,
    deepstack presence agrees, and every frame names the same fan-out. Over the set: either all
    frames are identity ``(0, span)`` (broadcast), or the non-empty shards, sorted by row_start,
    are contiguous (a block of the replica's shards). Anything else means the two sides' shard
    math diverged, and writing would corrupt rows, so the room fails instead.
    """
    for info in infos:
        who = f"receiver {info.session_id}"
        if info.hidden != chunk.hidden or info.dtype != chunk.dtype:
            return (
                f"{who} expects [*, {info.hidden}] {info.dtype}; "
                f"the encoded item is [*, {chunk.hidden}] {chunk.dtype}"
            )
        if info.span != chunk.n_tokens:
            return f"{who} expects {info.span} rows; the encoded item has {chunk.n_tokens}"
        if info.row_start + info.n_tokens > chunk.n_tokens:
            end = info.row_start + info.n_tokens
            return f"{who} asks rows [{info.row_start}, {end}) of {chunk.n_tokens}"
        if info.has_deepstack != bool(chunk.deepstack_nbytes):
            have = "has" if chunk.deepstack_nbytes else "has no"
            return f"{who} has_deepstack={int(info.has_deepstack)} but the item {have} deepstack"
        if info.required_dst_info_num != infos[0].required_dst_info_num:
            return "receivers disagree on the fan-out (required_dst_info_num)"
    if all(info.is_identity for info in infos):
        return None
    shards = sorted((i.row_start, i.n_tokens) for i in infos if i.n_tokens)
    for (start, n), (after, _) in itertools.pairwise(shards):
        if start + n != after:
            return f"row shards are not contiguous: [{start}, {start + n}) then [{after}, ...)"
    return None


@dataclass(frozen=True, slots=True, eq=False)
class Writes:
    """The descriptors for one receiver (absolute addresses); empty for a 0-row shard."""

    session: str
    src: U64
    dst: U64
    lengths: U64

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


def plan_writes(info: ItemInfo, chunk: ChunkMeta, base_ptr: int) -> Writes:
    """Rows ``[row_start, row_start + n_tokens)`` written contiguously at the info's pointers."""
    src: list[int] = []
    dst: list[int] = []
    lengths: list[int] = []
    if info.n_tokens:
        src.append(base_ptr + chunk.offset + info.row_start * chunk.row_bytes)
        dst.append(info.dst_ptr)
        lengths.append(info.n_tokens * chunk.row_bytes)
        if chunk.deepstack_nbytes:
            row = chunk.deepstack_row_bytes
            src.append(base_ptr + chunk.deepstack_offset + info.row_start * row)
            dst.append(info.deepstack_ptr)
            lengths.append(info.n_tokens * row)
    return Writes(
        info.session_id,
        np.asarray(src, dtype=np.uint64),
        np.asarray(dst, dtype=np.uint64),
        np.asarray(lengths, dtype=np.uint64),
    )
