"""What one ragged decode round looks like: items, block table, outputs, the backend contract.

Items and outputs are structs of numpy arrays that the caller allocates once (``empty``) and
the scheduler fills each round: no per-round allocation, and every column converts to a
device tensor in one call (``torch.from_numpy(items.position)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from tspd_core.sched.pool import PAGE_DTYPE, PageArray


@dataclass(frozen=True, slots=True)
class DecodeItems:
    """One row per request of a decode round, in slot order (caller-owned scratch)."""

    #: The request's scheduler slot (stable for its life).
    slot: NDArray[np.int32]
    #: The admission serial: with ``slot`` it identifies the request; outputs must echo both.
    serial: NDArray[np.int64]
    #: Position of the input token: its KV is written there (page ``position // page_size``).
    position: NDArray[np.int32]
    #: The input token, valid where ``token_on_host``; else the token is still on the device.
    token: NDArray[np.int32]
    #: True when the input token is known on the host (seeded, or its step was committed).
    token_on_host: NDArray[np.bool_]
    #: Where ``token_on_host`` is False: the row of this request in the previous round, whose
    #: output is this round's input (a device token feed reads it from there).
    feed_row: NDArray[np.int32]
    #: Start of this request's page table inside the round's concatenated block table.
    table_offset: NDArray[np.int32]
    #: Pages in that table, including the page reserved for ``position``.
    table_len: NDArray[np.int32]

    @classmethod
    def empty(cls, capacity: int) -> DecodeItems:
        """Scratch for rounds of up to ``capacity`` requests."""
        i32 = np.int32
        return cls(
            np.zeros(capacity, i32), np.zeros(capacity, np.int64), np.zeros(capacity, i32),
            np.zeros(capacity, i32), np.zeros(capacity, bool), np.zeros(capacity, i32),
            np.zeros(capacity, i32), np.zeros(capacity, i32),
        )  # fmt: skip

    def head(self, count: int) -> DecodeItems:
        """Views of the first ``count`` rows."""
        return DecodeItems(
            self.slot[:count], self.serial[:count], self.position[:count], self.token[:count],
            self.token_on_host[:count], self.feed_row[:count], self.table_offset[:count],
            self.table_len[:count],
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.slot)


@dataclass(frozen=True, slots=True)
class DecodeOutputs:
    """One row per item of a round, in item order: what the backend produced."""

    #: Echo of the item's slot (checked).
    slot: NDArray[np.int32]
    #: Echo of the item's serial (checked).
    serial: NDArray[np.int64]
    #: The sampled next token (must be in 0 .. 2**31-1).
    token: NDArray[np.int32]

    @classmethod
    def empty(cls, capacity: int) -> DecodeOutputs:
        return cls(
            np.zeros(capacity, np.int32), np.zeros(capacity, np.int64),
            np.zeros(capacity, np.int32),
        )  # fmt: skip

    def head(self, count: int) -> DecodeOutputs:
        return DecodeOutputs(self.slot[:count], self.serial[:count], self.token[:count])

    def __len__(self) -> int:
        return len(self.slot)


@dataclass(frozen=True, slots=True)
class DecodeRound:
    """The scheduler's output for one decode step: everything the backend needs to launch it.

    ``items`` and ``block_table`` are views of the caller's scratch: valid until the caller
    prepares another round into the same scratch (a pipelined engine double-buffers them).
    """

    #: Launch ticket: rounds are committed in this order (FIFO); abort only the newest.
    round_id: int
    #: Every DECODE request, in slot order.
    items: DecodeItems
    #: The items' page tables concatenated (item i at ``table_offset[i]``, ``table_len[i]``).
    block_table: PageArray
    #: Copy-on-write pairs ``[k, 2]`` (src page, dst page): copy each on the device before
    #: this round writes KV; the tables above already name the destinations.
    copies: NDArray[np.int32]
    #: Pages allocated for this round (new tail pages plus copy destinations), for metrics.
    new_pages: int

    @property
    def size(self) -> int:
        return len(self.items)


@dataclass(frozen=True, slots=True)
class RoundCommit:
    """What committing one round's tokens did."""

    #: The round committed.
    round_id: int
    #: Items whose token was recorded (their request advanced by one token).
    committed: int
    #: Items dropped: their request finished or discarded its pending steps after launch.
    dropped: int


class DecodeBackend(Protocol):
    """Runs one ragged decode step; called exactly once per synchronous decode round.

    Contract: perform ``batch.copies`` first, then for every item write the input token's KV
    at ``position`` through its page table and sample the next token; write one output row
    per item, in item order, into the first rows of ``out``; return the rows written. The
    scheduler checks count, slots and serials before changing any of its state.
    """

    def execute_ragged(self, batch: DecodeRound, out: DecodeOutputs) -> int: ...


def empty_copies() -> NDArray[np.int32]:
    return np.zeros((0, 2), dtype=PAGE_DTYPE)
