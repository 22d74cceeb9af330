"""A fixed-capacity buffer registered once with Mooncake, handed out in contiguous extents.

Both ends of EPD use one: the encode rank's *send buffer* (the vision tower's rows are copied in,
the transfer worker reads them out) and the prefill rank's *receive pool* (the encode rank
writes each item's rows into an extent). Registering one region for the life of the process
keeps the peers' cached view of it valid (re-registering recycled addresses per request is what
breaks RDMA keys), and makes the accounting exact: ``free_blocks`` returns to ``total_blocks``
once every extent came back.

    tensor  |blk0|blk1|blk2|blk3|blk4|blk5|blk6|blk7|...      (block_bytes each)
             └─ extent A ─┘    └ B ┘└── quarantined C ──┘
    free runs: [(3, 1), (8, ...)]  first fit, coalesced on free

An extent freed while a remote write may still target it (a request failed or was aborted
after its address went to the encode rank) is **quarantined** instead: it stays out of the free
runs until :meth:`lift` says the writer is done with it (its final status arrived) or until its
deadline passes (:meth:`sweep`), so a late write can never land in another request's rows.

Threading: a pool belongs to one thread (the scheduler, or the encode engine thread); the
transfer engine only reads and writes the bytes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from tspd_core.pd.errors import ConfigError, UsageError

#: Extents start on this boundary at least, so every dtype view of one is aligned.
MIN_BLOCK_BYTES = 64


@dataclass(frozen=True, slots=True)
class Extent:
    """``blocks`` contiguous blocks from block ``start``; ``nbytes`` is what was asked for."""

    start: int
    blocks: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of a pool's accounting (every block is in exactly one of the three)."""

    block_bytes: int
    total_blocks: int
    free_blocks: int
    used_blocks: int
    quarantined_blocks: int
    quarantined_extents: int


@dataclass(slots=True)
class _Held:
    extent: Extent
    deadline: float


class BufferPool:
    """``capacity_bytes`` (rounded down to whole blocks) of one tensor, first-fit extents."""

    def __init__(
        self,
        capacity_bytes: int,
        block_bytes: int = 4096,
        device: str | torch.device = "cpu",
        shared: bool = True,
    ) -> None:
        if block_bytes < MIN_BLOCK_BYTES or block_bytes % MIN_BLOCK_BYTES:
            raise ConfigError(
                f"block_bytes must be a multiple of {MIN_BLOCK_BYTES}, got {block_bytes}"
            )
        blocks = capacity_bytes // block_bytes
        if blocks < 1:
            raise ConfigError(f"a pool of {capacity_bytes} bytes holds no {block_bytes}-byte block")
        self.block_bytes = block_bytes
        self.total_blocks = blocks
        self.tensor = torch.zeros(blocks * block_bytes, dtype=torch.uint8, device=device)
        if self.tensor.device.type == "cpu" and shared:
            # Shared memory: the process that registers it with Mooncake may be another one.
            self.tensor.share_memory_()  # type: ignore[no-untyped-call]
        self._runs: list[tuple[int, int]] = [(0, blocks)]  # free (start, length), by start
        self._used: dict[int, int] = {}  # start -> blocks of every live extent
        self._held: dict[int, _Held] = {}  # quarantine key -> extent
        self._held_blocks = 0

    @property
    def base_ptr(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def nbytes(self) -> int:
        return self.total_blocks * self.block_bytes

    def ptr(self, extent: Extent, offset: int = 0) -> int:
        """Address of byte ``offset`` of ``extent``."""
        return self.base_ptr + extent.start * self.block_bytes + offset

    def view(self, extent: Extent, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` of ``extent`` as a uint8 view (no copy)."""
        if offset < 0 or offset + nbytes > extent.blocks * self.block_bytes:
            raise UsageError(f"bytes [{offset}, {offset + nbytes}) are outside {extent}")
        first = extent.start * self.block_bytes + offset
        return self.tensor[first : first + nbytes]

    # ---- allocation ---------------------------------------------------------------------

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` could ever be allocated (an empty pool has room for it)."""
        return self._blocks_for(nbytes) <= self.total_blocks

    def allocate(self, nbytes: int) -> Extent | None:
        """A contiguous extent of at least ``nbytes``, or None when no free run is long enough.

        Zero bytes give an empty extent at block 0 that holds no block.
        """
        need = self._blocks_for(nbytes)
        if need == 0:
            return Extent(0, 0, 0)
        for i, (start, length) in enumerate(self._runs):
            if length >= need:
                if length == need:
                    del self._runs[i]
                else:
                    self._runs[i] = (start + need, length - need)
                self._used[start] = need
                return Extent(start, need, nbytes)
        return None

    def free(self, extent: Extent) -> None:
        """Return a live extent to the free runs (coalescing with its neighbours)."""
        if extent.blocks == 0:
            return
        if self._used.get(extent.start) != extent.blocks:
            raise UsageError(f"{extent} is not a live extent of this pool (double free?)")
        del self._used[extent.start]
        self._insert_run(extent.start, extent.blocks)

    # ---- quarantine ---------------------------------------------------------------------

    def quarantine(self, key: int, extent: Extent, deadline: float) -> None:
        """Hold a live extent out of circulation until :meth:`lift` or ``deadline``."""
        if extent.blocks == 0:
            return
        if key in self._held:
            raise UsageError(f"quarantine key {key} is already holding {self._held[key].extent}")
        if self._used.get(extent.start) != extent.blocks:
            raise UsageError(f"{extent} is not a live extent of this pool")
        self._held[key] = _Held(extent, deadline)
        self._held_blocks += extent.blocks

    def is_held(self, key: int) -> bool:
        return key in self._held

    def lift(self, key: int) -> bool:
        """The writer of quarantine ``key`` is done: free its extent now (False if none held)."""
        held = self._held.pop(key, None)
        if held is None:
            return False
        self._held_blocks -= held.extent.blocks
        self.free(held.extent)
        return True

    def sweep(self, now: float) -> int:
        """Free every quarantined extent whose deadline passed; returns how many."""
        expired = [key for key, held in self._held.items() if held.deadline <= now]
        for key in expired:
            self.lift(key)
        return len(expired)

    # ---- accounting ---------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return sum(length for _, length in self._runs)

    def stats(self) -> PoolStats:
        free = self.free_blocks
        return PoolStats(
            block_bytes=self.block_bytes,
            total_blocks=self.total_blocks,
            free_blocks=free,
            used_blocks=self.total_blocks - free - self._held_blocks,
            quarantined_blocks=self._held_blocks,
            quarantined_extents=len(self._held),
        )

    def _blocks_for(self, nbytes: int) -> int:
        if nbytes < 0:
            raise UsageError(f"cannot allocate {nbytes} bytes")
        return -(-nbytes // self.block_bytes)

    def _insert_run(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self._runs, (start, 0))
        if i < len(self._runs) and self._runs[i][0] < start + length:
            raise UsageError(f"blocks {start}..{start + length - 1} overlap a free run")
        if i and self._runs[i - 1][0] + self._runs[i - 1][1] > start:
            raise UsageError(f"blocks {start}..{start + length - 1} overlap a free run")
        if i < len(self._runs) and self._runs[i][0] == start + length:
            length += self._runs.pop(i)[1]
        if i and self._runs[i - 1][0] + self._runs[i - 1][1] == start:
            prev_start, prev_len = self._runs[i - 1]
            self._runs[i - 1] = (prev_start, prev_len + length)
        else:
            self._runs.insert(i, (start, length))
