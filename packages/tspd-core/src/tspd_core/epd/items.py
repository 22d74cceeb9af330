"""The values EPD passes around: items to fetch, chunks to send, what landed, admission codes.

Ownership: every class here is an immutable value except that a :class:`LandedItem`'s tensors are
*views into the prefill rank's receive pool*. They stay valid until the request is released
(:meth:`EmbeddingReceiver.release`); copy them (or :func:`assemble`) before that if they must
outlive the request.

One multimodal item is one room (wire.md §2.5): the router gives every image its own
``{bootstrap_host, bootstrap_port, bootstrap_room}``, the encode node sends that item's
``[n_tokens, hidden]`` embedding (and, for deepstack models, ``[n_tokens, hidden * levels]``),
and each prefill rank receives either all rows (identity broadcast) or its row shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, StrEnum

import torch

from tspd_core.ids import MAX_ROOM, RequestId, Room
from tspd_core.pd.errors import UsageError

#: Rows of one item; far above any image's token count, low enough that sizes fit in int64.
MAX_ROWS = 1 << 24
#: Width of one row (hidden, or hidden * deepstack levels).
MAX_WIDTH = 1 << 20

#: The dtypes an embedding may have, by their wire name (Python's ``str(torch dtype)``).
DTYPES: dict[str, torch.dtype] = {
    str(d): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int8,
        torch.uint8,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype`` (``torch.bfloat16``); :class:`UsageError` if unsupported."""
    name = str(dtype)
    if name not in DTYPES:
        raise UsageError(f"embedding dtype {name} is not supported; use one of {sorted(DTYPES)}")
    return name


class Admission(IntEnum):
    """A staged request's EPD admission code on one rank (wire.md §1).

    The order is the order of progress with FAILED lowest, so a MIN all-reduce over the replica
    yields DONE only when every rank has every item, and FAILED as soon as one rank failed.
    """

    FAILED = 0
    PENDING = 1
    DONE = 2


class ShardMode(StrEnum):
    """How a prefill replica splits an item's rows between its ranks (wire.md §2.5)."""

    #: Every rank receives all rows (``row_start = 0``, ``n_tokens = span``).
    IDENTITY = "identity"
    #: Rank r of N receives a balanced contiguous block; the replica reassembles the item.
    ROWS = "rows"


def shard_rows(span: int, rank: int, size: int) -> tuple[int, int]:
    """``(row_start, n_rows)`` of rank ``rank`` of ``size`` for an item of ``span`` rows.

    The first ``span % size`` ranks get one extra row; the shards tile ``[0, span)`` in rank
    order, and a rank gets 0 rows when ``span < size``.
    """
    if not 0 <= rank < size:
        raise UsageError(f"rank {rank} is outside 0..{size - 1}")
    base, extra = divmod(span, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


@dataclass(frozen=True, slots=True)
class EmbeddingItem:
    """Prefill side: one multimodal item whose embedding an encode node will write.

    ``n_tokens`` is the item's full row count (its token count after merging), the same on
    every rank of the replica whatever the shard mode.
    """

    room: Room
    bootstrap_host: str  #: the encode node's bootstrap server
    bootstrap_port: int
    n_tokens: int

    def __post_init__(self) -> None:
        if not 0 <= self.room <= MAX_ROOM:
            raise UsageError(f"room {self.room} is outside 0..2**63-1")
        if not self.bootstrap_host or not 1 <= self.bootstrap_port <= 65535:
            raise UsageError(
                f"bootstrap address {self.bootstrap_host!r}:{self.bootstrap_port} is not host:port"
            )
        if not 1 <= self.n_tokens <= MAX_ROWS:
            raise UsageError(
                f"item of room {self.room}: n_tokens {self.n_tokens} not 1..{MAX_ROWS}"
            )

    @property
    def bootstrap_address(self) -> str:
        return f"{self.bootstrap_host}:{self.bootstrap_port}"


@dataclass(frozen=True, slots=True, eq=False)
class EmbeddingChunk:
    """Encode side: one item's embedding, ready to send (the vision tower's output rows).

    ``embedding`` is ``[n_tokens, hidden]``; ``deepstack``, for deepstack models, is
    ``[n_tokens, hidden * levels]`` of the same dtype. The sender copies both into its
    registered send buffer, so the caller may reuse the tensors once ``send`` returned.
    """

    room: Room
    embedding: torch.Tensor
    deepstack: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.room <= MAX_ROOM:
            raise UsageError(f"room {self.room} is outside 0..2**63-1")
        e = self.embedding
        if e.dim() != 2 or not 1 <= e.shape[0] <= MAX_ROWS or not 1 <= e.shape[1] <= MAX_WIDTH:
            raise UsageError(
                f"room {self.room}: embedding must be [n_tokens, hidden] with n_tokens "
                f"1..{MAX_ROWS}, got shape {tuple(e.shape)}"
            )
        dtype_name(e.dtype)
        d = self.deepstack
        if d is not None and (
            d.dim() != 2 or d.shape[0] != e.shape[0] or d.dtype != e.dtype or d.shape[1] < 1
        ):
            raise UsageError(
                f"room {self.room}: deepstack must be [{e.shape[0]}, hidden * levels] of "
                f"{e.dtype}, got {tuple(d.shape)} {d.dtype}"
            )

    @property
    def n_tokens(self) -> int:
        return int(self.embedding.shape[0])

    @property
    def hidden(self) -> int:
        return int(self.embedding.shape[1])

    @property
    def nbytes(self) -> int:
        return self.embedding.numel() * self.embedding.element_size()

    @property
    def deepstack_nbytes(self) -> int:
        d = self.deepstack
        return 0 if d is None else d.numel() * d.element_size()


@dataclass(frozen=True, slots=True, eq=False)
class LandedItem:
    """Prefill side: the rows of one item this rank received.

    ``embedding`` is ``[n_rows, hidden]`` and ``deepstack`` ``[n_rows, hidden * levels]`` (or
    None), views into the receive pool valid until the request is released. In identity mode
    ``row_start = 0`` and ``n_rows = span``; in row-shard mode they are this rank's shard.
    """

    room: Room
    span: int  #: the item's full row count
    row_start: int  #: first row of the item held here
    embedding: torch.Tensor
    deepstack: torch.Tensor | None
    mode: ShardMode

    @property
    def n_rows(self) -> int:
        return int(self.embedding.shape[0])


@dataclass(frozen=True, slots=True, eq=False)
class LandedRequest:
    """A request whose every item landed on every rank of the replica (admission DONE)."""

    rid: RequestId
    items: tuple[LandedItem, ...]


@dataclass(frozen=True, slots=True)
class FailedRequest:
    """A request the replica gave up on (admission FAILED on some rank): its buffers are
    released (or quarantined) already, and its PD room, if any, was aborted."""

    rid: RequestId
    reason: str
    pd_room: Room | None = None


@dataclass(frozen=True, slots=True, eq=False)
class Settlement:
    """What one :meth:`EmbeddingReceiver.settle` round decided, identical on every rank."""

    #: Requests whose embeddings are all here: admit them to prefill, then ``release`` them.
    admitted: tuple[LandedRequest, ...] = ()
    #: Requests that failed or timed out somewhere in the replica: finish them with an error.
    failed: tuple[FailedRequest, ...] = ()
