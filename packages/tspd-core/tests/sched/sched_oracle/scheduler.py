"""Oracle: the fixed-capacity request scheduler (admission, lifecycle, page tables, release)
as numpy operations: the model the native scheduler (``tspd_core.sched._slots`` and
``_rounds``) must match, page for page.

Decode rounds (synchronous and pipelined) live in :mod:`sched_oracle.decode`.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from sched_oracle.decode import DecodeRounds
from sched_oracle.pool import BlockPool
from sched_oracle.prefix import PrefixKvStore
from sched_oracle.slots import SlotTable
from sched_oracle.supply import PageSupply
from tspd_core.ids import RequestId
from tspd_core.sched.errors import ContextFull, InvalidInput, PoolExhausted, WrongState
from tspd_core.sched.keys import as_keys
from tspd_core.sched.pool import PAGE_DTYPE, PageArray
from tspd_core.sched.request import (
    Admission,
    CopyOnWrite,
    RequestState,
    RequestView,
    SchedulerStats,
)

_S = RequestState
# Module constants: an enum attribute or a union built per call costs ~0.1 µs, a noticeable
# share of a short request's admission.
_PREFILL, _PREFILLED = _S.PREFILL, _S.PREFILLED
_INTS = (int, np.integer)
_NO_KEYS: NDArray[np.uint64] = np.zeros(0, dtype=np.uint64)
_NO_KEYS.flags.writeable = False


class RequestScheduler(DecodeRounds):
    """A hard bound of ``capacity`` concurrent requests, each in a stable slot with a logical
    page table of ``logical_pages`` entries (max context ``logical_pages * page_size`` tokens).

    The scheduler owns one reference on every page in its requests' tables, taken from
    ``pool`` (and, for prefix hits, shared with ``prefixes``). Every method is atomic: it
    either completes or raises leaving all state (tables, reference counts, store) as it was.

    Prefix hits count whole pages and never cover the prompt's last token: a prompt that is
    all prefix recomputes its last page (``prefix_tokens <= (prompt_len-1) // page_size *
    page_size``), so prefill never writes into a shared page and a decode peer's prefix
    length is page aligned and below the prompt length (wire.md §5).

    Threading: not thread-safe. One engine loop (or one simulated instance) drives it; the
    page-table views it returns are valid until the next call that changes that request.
    """

    def __init__(
        self,
        capacity: int,
        logical_pages: int,
        *,
        page_size: int,
        pool: BlockPool,
        prefixes: PrefixKvStore | None = None,
    ) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise InvalidInput(f"page_size must be a positive int, got {page_size!r}")
        slots = SlotTable(capacity, logical_pages)
        super().__init__(slots, PageSupply(pool, prefixes), page_size)
        self._admissions = 0
        self._prompt_tokens = 0
        self._hit_tokens = 0

    # -- sizes and occupancy ------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._slots.capacity

    @property
    def logical_pages(self) -> int:
        return self._slots.logical_pages

    @property
    def pool(self) -> BlockPool:
        return self._supply.pool

    @property
    def prefixes(self) -> PrefixKvStore | None:
        return self._supply.store

    def active_count(self) -> int:
        """Requests holding a slot (O(1))."""
        return self._slots.active()

    def free_count(self) -> int:
        """Free pages in the pool (O(1))."""
        return self._supply.pool.free_count()

    def reclaimable_count(self) -> int:
        """Pages an allocation can obtain: free plus evictable prefix pages (O(1))."""
        return self._supply.reclaimable()

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._slots.index

    # -- admission ------------------------------------------------------------------------

    def admit(
        self,
        request_id: RequestId,
        prompt_len: int,
        page_keys: ArrayLike | None = None,
        *,
        remote_kv: bool = False,
    ) -> Admission:
        """Admit a request, attach its prefix hit, allocate all its prompt pages at once.

        ``page_keys`` are the chained keys of the prompt's full pages (``page_keys`` or
        ``page_keys_from_block_hashes``), at most ``prompt_len // page_size`` of them. With
        ``remote_kv`` the request waits for its prompt KV from a peer (PD decode side) instead
        of prefilling. Raises DuplicateRequest, CapacityFull, PoolExhausted, InvalidInput.
        """
        admission = self._admit(request_id, prompt_len, page_keys, remote_kv, 0)
        if admission is None:
            raise PoolExhausted(
                f"cannot admit {request_id!r}: {self._pages_for(prompt_len)} prompt pages minus "
                f"its prefix hit exceed the {self.reclaimable_count()} free or evictable pages; "
                "finish a request or retry later"
            )
        return admission

    def try_admit(
        self,
        request_id: RequestId,
        prompt_len: int,
        page_keys: ArrayLike | None = None,
        *,
        remote_kv: bool = False,
        headroom: int = 0,
    ) -> Admission | None:
        """Like :meth:`admit`, but an expected shortage (no free slot, too few pages) returns
        None with nothing changed. Bad input and duplicates still raise.

        ``headroom`` (a watermark) also counts as a shortage fewer than that many pages left
        free or evictable after the admission, e.g. pages the caller holds back for outputs."""
        if not isinstance(headroom, int) or headroom < 0:
            raise InvalidInput(f"headroom must be an int >= 0, got {headroom!r}")
        if not self._slots.has_free_slot() and request_id not in self._slots.index:
            self._check_prompt(request_id, prompt_len, page_keys)
            return None
        return self._admit(request_id, prompt_len, page_keys, remote_kv, headroom)

    def _admit(
        self,
        request_id: RequestId,
        prompt_len: int,
        page_keys: ArrayLike | None,
        remote: bool,
        headroom: int,
    ) -> Admission | None:
        keys = self._check_prompt(request_id, prompt_len, page_keys)
        s = self._slots
        s.check_new(request_id)
        need_total = self._pages_for(prompt_len)
        limit = (prompt_len - 1) // self.page_size
        hit = self._supply.match(keys, limit)
        if not self._supply.can_supply(need_total - len(hit) + headroom, hit):
            return None
        self._supply.acquire(hit)
        fresh = self._supply.allocate(need_total - len(hit))
        assert fresh is not None, "can_supply promised these pages"
        slot = s.take(request_id)
        s.tables[slot, : len(hit)] = hit
        s.tables[slot, len(hit) : need_total] = fresh
        s.num_pages[slot] = need_total
        s.prompt_len[slot] = prompt_len
        s.prefix_tokens[slot] = s.kv_len[slot] = len(hit) * self.page_size
        s.keys[slot] = keys if len(keys) else None
        s.state[slot] = _S.AWAITING_KV if remote else _S.PREFILL
        self._admissions += 1
        self._prompt_tokens += prompt_len
        self._hit_tokens += len(hit) * self.page_size
        pages = s.tables[slot, :need_total].copy()
        return Admission(
            request_id, slot, int(s.serial[slot]), _S.AWAITING_KV if remote else _S.PREFILL,
            prompt_len, len(hit) * self.page_size, pages, len(hit),
        )  # fmt: skip

    def _check_prompt(
        self, request_id: RequestId, prompt_len: int, page_keys: ArrayLike | None = None
    ) -> NDArray[np.uint64]:
        if not isinstance(prompt_len, _INTS) or not 1 <= prompt_len <= self.max_context:
            raise InvalidInput(
                f"request {request_id!r}: prompt_len must be in 1 .. {self.max_context} "
                f"(logical_pages x page_size), got {prompt_len!r}"
            )
        keys = _NO_KEYS if page_keys is None else as_keys(page_keys)
        if len(keys) > prompt_len // self.page_size:
            raise InvalidInput(
                f"request {request_id!r}: {len(keys)} page keys for a {prompt_len}-token prompt "
                f"with {prompt_len // self.page_size} full pages; pass keys of full pages only"
            )
        return keys

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    # -- lifecycle ------------------------------------------------------------------------

    def advance_prefill(self, request_id: RequestId, num_tokens: int) -> int:
        """Record ``num_tokens`` more prompt tokens prefilled (chunked prefill); return the
        prefilled total. Their pages were allocated at admission."""
        slot = self._in_state(request_id, "advance_prefill", _S.PREFILL)
        done = int(self._slots.kv_len[slot])
        left = int(self._slots.prompt_len[slot]) - done
        if not isinstance(num_tokens, int) or not 1 <= num_tokens <= left:
            raise InvalidInput(
                f"request {request_id!r}: advance_prefill by {num_tokens!r}; {left} of its "
                "prompt tokens are left to prefill"
            )
        self._slots.kv_len[slot] = done + num_tokens
        return done + num_tokens

    def mark_prefill_complete(self, request_id: RequestId) -> None:
        """All prompt KV is written: offer the full prompt pages to the prefix store and wait
        for the first decode token (or, on a PD prefill peer, hold the pages until finish)."""
        self._complete_prompt(self._in_state(request_id, "mark_prefill_complete", _S.PREFILL))

    def seed_decode_token(self, request_id: RequestId, token: int) -> None:
        """Publish the token the next decode step consumes (the first token sampled after
        prefill, or the first token that arrived with the KV on a PD decode peer) and make
        the request runnable. From AWAITING_KV this also completes the prompt."""
        slot = self._in_state(request_id, "seed_decode_token", _S.PREFILLED, _S.AWAITING_KV)
        _check_token(request_id, token)
        if self._slots.state[slot] == _S.AWAITING_KV:
            self._complete_prompt(slot)
        self._slots.token[slot] = token
        self._slots.has_token[slot] = True
        self._slots.state[slot] = _S.DECODE

    def _complete_prompt(self, slot: int) -> None:
        s = self._slots
        s.kv_len[slot] = s.prompt_len[slot]
        keys = s.keys[slot]
        if keys is not None:
            self._supply.insert(keys, s.tables[slot, : len(keys)])
            s.keys[slot] = None
        s.state[slot] = _PREFILLED

    def record_token(self, request_id: RequestId, token: int) -> CopyOnWrite | None:
        """One decode step done outside a round: same as ``record_tokens(id, [token])``."""
        return self.record_tokens(request_id, np.array([token]))

    def record_tokens(self, request_id: RequestId, tokens: int | ArrayLike) -> CopyOnWrite | None:
        """Advance a decode request by several tokens at once (bulk path for the simulator).

        ``tokens`` is either a count (token ids unknown here: the next input stays off the
        host) or the token ids (the last one becomes the next input). Pages for the new
        positions are allocated; if the first written page is shared it is copied on write and
        the copy returned. Raises WrongState with steps in flight, ContextFull, PoolExhausted.
        """
        slot = self._in_state(request_id, "record_tokens", _S.DECODE)
        count, last = _count_tokens(request_id, tokens)
        s = self._slots
        if s.pending[slot]:
            raise WrongState(
                f"request {request_id!r} has {s.pending[slot]} decode steps in flight; commit "
                "or discard them before recording tokens directly"
            )
        start = int(s.kv_len[slot])
        if start + count > self.max_context:
            raise ContextFull(
                f"request {request_id!r}: {start} + {count} tokens exceed the max context of "
                f"{self.max_context}; finish it"
            )
        copy = self._reserve(slot, start, start + count)
        s.kv_len[slot] = start + count
        if count:
            s.has_token[slot] = last is not None
            s.token[slot] = 0 if last is None else last
        return copy

    def _reserve(self, slot: int, start: int, end: int) -> CopyOnWrite | None:
        # Pages for positions [start, end): new tail pages plus a copy of a shared first page.
        s = self._slots
        have = int(s.num_pages[slot])
        grow = max(0, self._pages_for(end) - have)
        first = start // self.page_size
        shared = end > start and first < have and self.pool.refcounts[s.tables[slot, first]] > 1
        fresh = self._supply.allocate(grow + int(shared))
        if fresh is None:
            raise PoolExhausted(
                f"request {self._slots.rids[slot]!r} needs {grow + int(shared)} pages, "
                f"{self.reclaimable_count()} free or evictable; finish or preempt a request"
            )
        s.tables[slot, have : have + grow] = fresh[:grow]
        s.num_pages[slot] = have + grow
        if not shared:
            return None
        return self._copy_on_write(slot, first, int(fresh[grow]))

    def _copy_on_write(self, slot: int, logical_page: int, dst: int) -> CopyOnWrite:
        src = int(self._slots.tables[slot, logical_page])
        self._slots.tables[slot, logical_page] = dst
        self._supply.release(np.array([src], dtype=PAGE_DTYPE))
        self._cow_copies += 1
        return CopyOnWrite(logical_page, src, dst)

    def ensure_writable(self, request_id: RequestId, logical_page: int) -> CopyOnWrite | None:
        """Make ``logical_page`` private before writing it: None if it already is, else the
        copy the backend must perform (src → dst) before writing (copy-on-write)."""
        slot = self._slots.lookup(request_id)
        have = int(self._slots.num_pages[slot])
        if not isinstance(logical_page, int) or not 0 <= logical_page < have:
            raise InvalidInput(
                f"request {request_id!r}: logical page {logical_page!r} outside its {have} pages"
            )
        if self.pool.refcounts[self._slots.tables[slot, logical_page]] <= 1:
            return None
        fresh = self._supply.allocate(1)
        if fresh is None:
            raise PoolExhausted(
                f"copy-on-write for {request_id!r} needs a page and none is free or evictable"
            )
        return self._copy_on_write(slot, logical_page, int(fresh[0]))

    def fork(self, parent_id: RequestId, child_id: RequestId) -> Admission:
        """Start ``child_id`` sharing every page of ``parent_id`` (parallel sampling): the
        first write of either into a shared page is copied on write. The parent must be
        PREFILLED or DECODE with no step in flight; the child starts in the same state."""
        slot = self._in_state(parent_id, "fork", _S.PREFILLED, _S.DECODE)
        s = self._slots
        if s.pending[slot]:
            raise WrongState(f"request {parent_id!r} has decode steps in flight; fork after commit")
        s.check_new(child_id)
        pages = s.tables[slot, : s.num_pages[slot]].copy()
        self.pool.incref(pages, trusted=True)  # held by the parent: never an evictable entry
        child = s.take(child_id)
        s.tables[child, : len(pages)] = pages
        for column in (s.num_pages, s.prompt_len, s.prefix_tokens, s.kv_len, s.token):
            column[child] = column[slot]
        s.has_token[child] = s.has_token[slot]
        s.state[child] = s.state[slot]
        return Admission(
            child_id, child, int(s.serial[child]), _S(int(s.state[child])),
            int(s.prompt_len[child]), int(s.prefix_tokens[child]), pages, len(pages),
        )  # fmt: skip

    def finish(self, request_id: RequestId) -> None:
        """Release every page of the request and free its slot (completion and cancellation
        alike, in any state; outputs of its steps still in flight are dropped at commit)."""
        slot = self._slots.lookup(request_id)
        count = int(self._slots.num_pages[slot])
        self._supply.release(self._slots.tables[slot, :count].copy())
        self._slots.clear(slot)

    # -- inspection -----------------------------------------------------------------------

    def state(self, request_id: RequestId) -> RequestState:
        return _S(int(self._slots.state[self._slots.lookup(request_id)]))

    def page_table(self, request_id: RequestId) -> PageArray:
        """Read-only int32 view of the request's page table (valid until it next changes)."""
        slot = self._slots.lookup(request_id)
        view = self._slots.tables[slot, : self._slots.num_pages[slot]]
        view.flags.writeable = False
        return view

    def num_pages(self, request_id: RequestId) -> int:
        return int(self._slots.num_pages[self._slots.lookup(request_id)])

    def slot_of(self, request_id: RequestId) -> int:
        return self._slots.lookup(request_id)

    def request_id_at(self, slot: int) -> RequestId | None:
        """The request in ``slot``, or None for a free slot."""
        return self._slots.rids[slot]

    def view(self, request_id: RequestId) -> RequestView:
        slot = self._slots.lookup(request_id)
        s = self._slots
        token = int(s.token[slot]) if s.has_token[slot] and not s.pending[slot] else None
        return RequestView(
            request_id, slot, int(s.serial[slot]), _S(int(s.state[slot])),
            int(s.prompt_len[slot]), int(s.prefix_tokens[slot]), int(s.kv_len[slot]),
            int(s.pending[slot]), int(s.num_pages[slot]), token,
        )  # fmt: skip

    def runnable_into(self, out: NDArray[np.int32]) -> int:
        """Write the slots of all runnable requests (PREFILL or DECODE) into ``out`` in slot
        order; return how many. ``out`` must hold ``capacity`` entries at worst."""
        state = self._slots.state
        slots = np.flatnonzero((state == _S.PREFILL) | (state == _S.DECODE))
        if len(out) < len(slots):
            raise InvalidInput(f"runnable_into: {len(slots)} runnable, out holds {len(out)}")
        out[: len(slots)] = slots
        return len(slots)

    def stats(self) -> SchedulerStats:
        store = self._supply.store
        return SchedulerStats(
            self.active_count(), self.free_count(), 0 if store is None else len(store),
            0 if store is None else store.evictable_count(), self._admissions,
            self._prompt_tokens, self._hit_tokens, self._cow_copies, self._rounds_committed,
            0 if store is None else store.evicted_total,
        )  # fmt: skip

    def _in_state(self, request_id: RequestId, what: str, *allowed: RequestState) -> int:
        slot = self._slots.lookup(request_id)
        state = int(self._slots.state[slot])
        if state not in allowed:
            names = " or ".join(a.name for a in allowed)
            raise WrongState(f"{what}: request {request_id!r} is {_S(state).name}, needs {names}")
        return slot


def _check_token(request_id: RequestId, token: object) -> None:
    if not isinstance(token, int | np.integer) or not 0 <= token <= np.iinfo(np.int32).max:
        raise InvalidInput(f"request {request_id!r}: token must be an int in 0 .. 2**31-1")


def _count_tokens(request_id: RequestId, tokens: int | ArrayLike) -> tuple[int, int | None]:
    if isinstance(tokens, int | np.integer):
        if tokens < 0:
            raise InvalidInput(f"request {request_id!r}: cannot record {tokens} tokens")
        return int(tokens), None
    ids = np.asarray(tokens)
    if ids.ndim != 1 or (len(ids) and ids.dtype.kind not in "iu"):
        raise InvalidInput(f"request {request_id!r}: tokens must be a count or 1-D int array")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) > np.iinfo(np.int32).max):
        raise InvalidInput(f"request {request_id!r}: token ids must lie in 0 .. 2**31-1")
    return len(ids), (int(ids[-1]) if len(ids) else None)
