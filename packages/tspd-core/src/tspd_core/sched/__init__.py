"""Request scheduler: block pool, prefix store, copy-on-write and ragged decode rounds.

One native implementation (Cython, ``_*.pyx``) owns the pool, prefix-store and slot state and
holds every rule that changes it; numpy is its only dependency (no torch, no sockets): the
reference engine, the PD peers and the simulator all run this same code. See
docs/scheduler.md for the lifecycle and ownership rules.
"""

from tspd_core.sched._prefix import PrefixKvStore
from tspd_core.sched.errors import (
    BackendMismatch,
    CapacityFull,
    ContextFull,
    DuplicateRequest,
    InvalidInput,
    PoolExhausted,
    SchedulerError,
    UnknownRequest,
    WrongState,
)
from tspd_core.sched.keys import as_keys, page_keys, page_keys_from_block_hashes
from tspd_core.sched.pool import PAGE_DTYPE, BlockPool, PageArray
from tspd_core.sched.request import (
    Admission,
    CopyOnWrite,
    RequestState,
    RequestView,
    SchedulerStats,
)
from tspd_core.sched.rounds import (
    DecodeBackend,
    DecodeItems,
    DecodeOutputs,
    DecodeRound,
    RoundCommit,
)
from tspd_core.sched.scheduler import RequestScheduler

__all__ = [
    "PAGE_DTYPE",
    "Admission",
    "BackendMismatch",
    "BlockPool",
    "CapacityFull",
    "ContextFull",
    "CopyOnWrite",
    "DecodeBackend",
    "DecodeItems",
    "DecodeOutputs",
    "DecodeRound",
    "DuplicateRequest",
    "InvalidInput",
    "PageArray",
    "PoolExhausted",
    "PrefixKvStore",
    "RequestScheduler",
    "RequestState",
    "RequestView",
    "RoundCommit",
    "SchedulerError",
    "SchedulerStats",
    "UnknownRequest",
    "WrongState",
    "as_keys",
    "page_keys",
    "page_keys_from_block_hashes",
]
