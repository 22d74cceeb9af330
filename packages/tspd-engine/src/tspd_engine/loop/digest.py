"""The cross-rank check that every rank's scheduler holds the same state.

Every rank of a replica applies the same intake in the same order, so their schedulers must
hold the same requests with the same page tables: PD transfers address pages by id. The
ranks compare a digest of that state (``EngineCore.state_digest``) every few rounds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from tspd_core.ids import RequestId
from tspd_core.sched import RequestScheduler


def state_digest(sched: RequestScheduler, waiting: int, tracked: Iterable[str]) -> int:
    """A 63-bit digest of ``sched``'s free pages, the ``waiting`` count and, per request of
    ``tracked`` (admitted or held, in order), its id, length, pending steps and page table:
    equal digests mean equal block ids on every rank."""
    h = hashlib.blake2b(digest_size=8)
    h.update(np.array([sched.free_count(), waiting], np.int64).tobytes())
    for rid in tracked:
        view = sched.view(RequestId(rid))
        h.update(rid.encode() + b"\0")
        h.update(np.array([view.num_tokens, view.pending], np.int64).tobytes())
        h.update(sched.page_table(RequestId(rid)).tobytes())
    return int.from_bytes(h.digest(), "little") >> 1
