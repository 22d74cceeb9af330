"""A short request's life — admission, prompt completion, finish — as one flat function each.

Most requests are short, and for a few pages the cost of a call is the call itself: a numpy
call is ~1 µs whatever its size, a Python method call ~0.1 µs, a page's work ~20-40 ns.
So a request of up to :data:`~tspd_core.sched.pool.SMALL_PAGES` pages takes these three
functions, which do the pool's, the prefix store's and the slot table's work inline, page
by page, on ``memoryview`` s of their arrays (and on their counters). They and their compiled
twin are the only code that reaches into those objects' internals, and they follow the same
rules as the array path exactly: the same pages in the same order, the same hits,
evictions, recency stamps and free-stack order (``tests/sched``: a churn and a stateful
machine run both paths side by side, on checked and unchecked pools).

The same three steps are compiled too (``_lives.c``, built by ``setup.py`` where a C
compiler is found): the scheduler takes that path for requests of up to
:data:`COMPILED_PAGES` pages, and these functions where it is not built, or where the pool
checks every call (``strict``: the checks are Python's). A life of <= 8 pages costs 6.0-6.5
µs compiled against 14.4-15.8 here and 8.5-9.0 for the per-page loop baseline (1.36-1.41x
of the loop; <= 64 pages 2.2-2.3x, <= 256 pages 2.3-2.5x; ``nox -s bench -- scheduler``
prints both paths).

Measured (``nox -s bench -- scheduler --only short``, three interleaved pairs): a life of
<= 8 pages with prefix hits on a full pool went from 13.7-16.4 µs through the pool's, store's
and slot table's per-page calls to 9.4-10.2 µs (0.34-0.40x of the per-page loop baseline to
0.55-0.59x); <= 64 pages 0.30-0.33x to 0.54-0.56x. Taking and clearing the slot through
the slot table's own calls, and checking input through the scheduler's, costs ~5 % of that
(0.51-0.55x in three more pairs) and keeps one copy of each.
"""

from __future__ import annotations

import numpy as np

from tspd_core.ids import RequestId
from tspd_core.sched.request import Admission, RequestState
from tspd_core.sched.slots import SlotTable
from tspd_core.sched.supply import PageSupply

try:  # the same three steps compiled (setup.py builds it where a C compiler is found)
    from tspd_core.sched._lives import Lives as _Compiled
except ImportError:  # pragma: no cover - a build without the compiled module
    _Compiled = None  # type: ignore[assignment,misc]

#: The compiled short path's type, None where this install has none.
Lives: type[_Compiled] | None = _Compiled

#: Whether this install has the compiled short path (``tspd_core.sched._lives``).
COMPILED = Lives is not None
#: Up to this many pages the compiled path does a request's life: its per-page cost is a few
#: ns, so it beats numpy's fixed ~1 µs a call to 256 pages at least (2.3-2.5x the per-page loop
#: there, where numpy's path is 0.85-0.9x); beyond, the 768-page admission's vectorised prefix
#: match (a few dict look-ups for a whole run) is the better algorithm.
COMPILED_PAGES = 256

_AWAITING_KV, _PREFILL = RequestState.AWAITING_KV, RequestState.PREFILL


class ShortLives:
    """The short-request half of :class:`~tspd_core.sched.RequestScheduler` (same object)."""

    _slots: SlotTable
    _supply: PageSupply
    page_size: int
    _admissions: int
    _prompt_tokens: int
    _hit_tokens: int

    def _admit_short(
        self,
        request_id: RequestId,
        prompt_len: int,
        keys: list[int],
        remote: bool,
        headroom: int,
        need: int,
    ) -> Admission | None:
        """Admit a checked request of ``need`` pages (``keys``: its full pages' keys, maybe
        none): its stored prefix, then fresh pages, evicting if the pool is short. None, with
        nothing changed, when fewer than ``need - hits + headroom`` pages can be had."""
        pool, store = self._supply.pool, self._supply.store
        rc = pool._rc
        hit: list[int] = []
        limit = (prompt_len - 1) // self.page_size  # the last token is always recomputed
        if store is not None and keys and limit:
            page_of, run, key = store._page_of, store._run_py, store._key_py
            for k in keys if len(keys) <= limit else keys[:limit]:
                page = page_of.get(k)
                if page is None or not run[page] or key[page] != k:
                    break  # missing, or a stale entry
                hit.append(page)
        h = len(hit)
        count = need - h
        free = pool._top
        spare = free if store is None else free + store._evictable
        # The hits stop being evictable once held: counted only when the worst case misses.
        if count + headroom > spare - h and count + headroom > spare - sum(
            1 for page in hit if rc[page] == 1
        ):
            return None
        if h:
            assert store is not None
            if pool.strict:
                pool.check(hit, "incref")
            stamp, lone = store._stamp_mv, 0
            for page in hit:
                rc[page] += 1
                if stamp[page]:
                    stamp[page] = 0  # was evictable: no longer
                    lone += 1
            store._evictable -= lone
        pages = hit
        if count > free:  # evict the shortfall: oldest entries first
            assert store is not None
            evicted = store._drop_list(count - free)
            if pool.strict:  # through the free stack, checked; it hands them back first
                pool.free_unshared(np.array(evicted, dtype=np.intp))
                free = pool._top
            else:  # held by the store alone: straight to the new holder, count kept at 1
                pages = hit + evicted
                count -= len(evicted)
        if count:
            fresh: list[int] = pool._fs[free - count : free].tolist()
            fresh.reverse()  # the stack's top first
            for page in fresh:
                rc[page] = 1
            pool._top = free - count
            pages = pages + fresh if pages else fresh
        # The slot (the lowest free one), then its row and columns written item by item.
        s = self._slots
        slot = s.take(request_id)
        serial = s.serials_issued
        row, i = s.at_table, slot * s.logical_pages
        for page in pages:
            row[i] = page
            i += 1
        s.at_num_pages[slot] = need
        s.at_prompt_len[slot] = prompt_len
        prefix = h * self.page_size
        s.at_prefix_tokens[slot] = s.at_kv_len[slot] = prefix
        s.keys[slot] = keys or None
        state = _AWAITING_KV if remote else _PREFILL
        s.at_state[slot] = state
        self._admissions += 1
        self._prompt_tokens += prompt_len
        self._hit_tokens += prefix
        return Admission(request_id, slot, serial, state, prompt_len, prefix, pages, h)

    def _finish_short(self, slot: int, count: int) -> None:
        """Release the slot's ``count`` pages (its store's release, page by page: recency
        stamped root-newest, freed pages back on the stack in table order) and free it."""
        s = self._slots
        pool, store = self._supply.pool, self._supply.store
        base = slot * s.logical_pages
        pages: list[int] = s.at_table[base : base + count].tolist()
        if pool.strict:
            pool.check(pages, "decref")
        rc = pool._rc
        freed: list[int] = []
        if store is None:
            for page in pages:
                c = rc[page] - 1
                rc[page] = c
                if not c:
                    freed.append(page)
        else:
            run = store._run_py
            lone: list[int] = []  # cached and held by the store alone now: evictable
            for page in pages:
                c = rc[page] - 1
                rc[page] = c
                if not c:
                    freed.append(page)
                elif c == 1 and run[page]:
                    lone.append(page)
            n = len(lone)
            if n:  # leaf first into the queue: the root gets the newest stamp
                clock = store._clock
                store._clock = clock + n
                stamp = store._stamp_mv
                for page in lone:
                    stamp[page] = clock + n
                    n -= 1
                lone.reverse()
                store._queue.push_list(lone, clock + 1, store._live)
                store._evictable += len(lone)
        if freed:  # the next allocation pops them in table order
            fs, top = pool._fs, pool._top
            for page in reversed(freed):
                fs[top] = page
                top += 1
            pool._top = top
        s.clear(slot)
