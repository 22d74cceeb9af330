"""Oracle: the block pool: physical KV pages with reference counts.

Pages are numbered ``1 .. num_pages`` (the arena's page ids, wire.md §4/§5); page 0 is the null
page, is never handed out and never counted. A page is *free* when its reference count is 0 and
*used* otherwise, so ``free_count() + used_count() == num_pages`` at all times.

Free pages sit on a stack. Allocation pops the most recently freed pages first (warm pages
stay warm) and is deterministic: a fresh pool hands out ``1, 2, 3, ...`` in that order, and
pages released together come back in the order they were released.

The tests' oracle: the numpy model the native pool (``tspd_core.sched._pool``) must match.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from tspd_core.sched.errors import InvalidInput, PoolExhausted
from tspd_core.sched.pool import PAGE_DTYPE, PageArray

#: Page ids as fancy indices. numpy casts any other index dtype on every fancy get or set,
#: which costs 1-3 µs a call whatever its size (5-7x an intp index of 10-200 pages), so the
#: pool and the prefix store index with intp internally and convert at their edges.
IndexArray = NDArray[np.intp]


def as_index(pages: ArrayLike) -> IndexArray:
    """``pages`` as an intp index array (no copy when it already is one); anything but
    integers is refused, so a conversion never hides bad input from the id checks."""
    ids = np.asarray(pages)
    if ids.dtype == np.intp:
        return ids
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise InvalidInput(f"page ids must be a 1-D integer array, got {ids!r}")
    return ids.astype(np.intp)


class BlockPool:
    """Reference-counted physical pages ``1 .. num_pages`` of one rank's KV arena.

    Ownership: every holder of a page (a request's page table, the prefix store) owns exactly
    one reference and gives it back exactly once. Page id arrays passed to :meth:`incref` and
    :meth:`decref` must not repeat an id (checked).

    Checks: :meth:`incref` and :meth:`decref` validate their ids (range, in use, no repeat)
    unless the caller passes ``trusted=True`` (the scheduler and prefix store do, for ids taken
    from their own tables); ``strict=True`` validates trusted calls too (tests use it).

    Threading: not thread-safe. One engine loop (or one simulated instance) owns the pool; the
    scheduler and the prefix store built on it are driven from that same loop.
    """

    __slots__ = (
        "_free",
        "_mark",
        "_num_pages",
        "_refcount",
        "_top",
        "_view",
        "strict",
    )

    def __init__(self, num_pages: int, *, strict: bool = False) -> None:
        if not isinstance(num_pages, int) or num_pages < 1 or num_pages > np.iinfo(np.int32).max:
            raise InvalidInput(f"num_pages must be an int in 1 .. 2**31-1, got {num_pages!r}")
        self._num_pages = num_pages
        self._refcount = np.zeros(num_pages + 1, dtype=np.int32)
        self._view = self._refcount.view()  # made once: callers read counts on hot paths
        self._view.flags.writeable = False
        # Stack of free ids, top at the end; stored descending so page 1 comes out first.
        self._free = np.arange(num_pages, 0, -1, dtype=np.intp)
        self._top = num_pages
        self._mark = np.zeros(num_pages + 1, dtype=np.int64)  # scratch for duplicate checks
        self.strict = strict

    @property
    def num_pages(self) -> int:
        """Pages this pool manages (the null page excluded)."""
        return self._num_pages

    def free_count(self) -> int:
        """Pages with no reference (O(1))."""
        return self._top

    def used_count(self) -> int:
        """Pages with at least one reference (O(1))."""
        return self._num_pages - self._top

    def refcount(self, page: int) -> int:
        """References currently held on ``page``."""
        self._check_id(page)
        return int(self._refcount[page])

    @property
    def refcounts(self) -> NDArray[np.int32]:
        """Read-only view of every page's reference count, indexed by page id (0 = null)."""
        return self._view

    def try_allocate(self, count: int) -> PageArray | None:
        """Take ``count`` free pages (reference count 1 each), or ``None`` if too few are free."""
        if count < 0:
            raise InvalidInput(f"cannot allocate a negative number of pages ({count})")
        if count > self._top:
            return None
        top = self._top
        taken = self._free[top - count : top]
        self._refcount[taken] = 1
        self._top = top - count
        return taken[::-1].astype(PAGE_DTYPE)

    def allocate(self, count: int) -> PageArray:
        """Take ``count`` free pages; raise :class:`PoolExhausted` if too few are free."""
        pages = self.try_allocate(count)
        if pages is None:
            raise PoolExhausted(
                f"block pool has {self._top} free pages of {self._num_pages}, {count} requested; "
                "finish or preempt a request, or size the pool larger"
            )
        return pages

    def incref(self, pages: ArrayLike, *, trusted: bool = False) -> None:
        """Add one reference to each (already used) page in ``pages``."""
        idx = as_index(self._checked(pages, "incref") if self.strict or not trusted else pages)
        self._refcount[idx] += 1

    def decref(self, pages: ArrayLike, *, trusted: bool = False) -> PageArray:
        """Drop one reference from each page; return the pages that became free.

        Freed pages go back on the free stack so that the next allocation returns them in the
        order they appear in ``pages``.
        """
        idx = as_index(self._checked(pages, "decref") if self.strict or not trusted else pages)
        counts = self._refcount[idx] - 1
        self._refcount[idx] = counts
        freed: IndexArray = idx[counts == 0]
        n = len(freed)
        if n:
            self._free[self._top : self._top + n] = freed[::-1]
            self._top += n
        return freed.astype(PAGE_DTYPE)

    def free_unshared(self, pages: IndexArray) -> None:
        """Drop the only reference of each page in ``pages`` (intp ids, each held once by the
        caller alone: the prefix store's evictions). Same free-stack order as :meth:`decref`.

        Checked like :meth:`decref` in strict mode; otherwise trusted."""
        if self.strict:
            self._checked(pages, "free_unshared")
            if np.count_nonzero(self._refcount[pages] != 1):
                raise InvalidInput("free_unshared: pages held more than once")
        n = len(pages)
        self._refcount[pages] = 0
        self._free[self._top : self._top + n] = pages[::-1]
        self._top += n

    def check(self, pages: ArrayLike, what: str) -> None:
        """Refuse ids :meth:`incref` / :meth:`decref` would refuse (out of range, free,
        repeated) with :class:`InvalidInput`; what strict mode checks."""
        self._checked(pages, what)

    def _checked(self, pages: ArrayLike, what: str) -> IndexArray:
        ids = np.asarray(pages)
        if ids.ndim != 1 or (len(ids) and ids.dtype.kind not in "iu"):
            raise InvalidInput(f"{what}: page ids must be a 1-D integer array, got {ids!r}")
        ids = ids.astype(np.intp, copy=False)
        n = len(ids)
        if n == 0:
            return ids
        if int(ids.min()) < 1 or int(ids.max()) > self._num_pages:
            raise InvalidInput(f"{what}: page ids must lie in 1 .. {self._num_pages}, got {ids}")
        if not np.all(self._refcount[ids] > 0):
            bad = ids[self._refcount[ids] <= 0]
            raise InvalidInput(f"{what}: pages {bad.tolist()} are free (no reference to move)")
        # Fancy-index updates apply once per distinct id, so a repeated id would lose a count.
        order = np.arange(n, dtype=np.int64)
        self._mark[ids] = order
        if not np.array_equal(self._mark[ids], order):
            raise InvalidInput(f"{what}: page ids repeat in {ids.tolist()}")
        return ids

    def _check_id(self, page: int) -> None:
        if not 1 <= page <= self._num_pages:
            raise InvalidInput(f"page id {page} outside 1 .. {self._num_pages}")
