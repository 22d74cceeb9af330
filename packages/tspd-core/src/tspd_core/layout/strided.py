"""Strided copy runs: the plan without a descriptor per token row.

Between unequal TP sizes in token-major (NHD) pages a P rank's heads are a slice of every
token row of D's page, so :func:`~tspd_core.layout.copies.plan_copies` emits one descriptor per
token per field (8.4 M for a 128k-token GQA request at TP 4 → 2). :func:`plan_runs` describes
the same bytes as **runs**: run ``i`` copies ``count[i]`` pieces of ``length[i]`` bytes, piece
``j`` from ``src[i] + j·src_step[i]`` to ``dst[i] + j·dst_step[i]``::

    P page (2 heads)   [t0 h0-1][t1 h0-1][t2 h0-1][t3 h0-1]          src_step = 2 heads
    D page (4 heads)   [t0 h0-1 | h2-3][t1 h0-1 | h2-3] ...           dst_step = 4 heads
                       4 descriptors of one token row each  →  1 run, count 4

A fragment (wire.md §6.2) of one page pair is one run; a run continues into its neighbour
(the next page, or the next field of a page-major arena) when the neighbour has the same
piece length and steps and starts exactly one run-span further on both sides, and then the
two are merged (count added). Groups without strided fragments take the coalescing planner
as they are (every run has ``count == 1``), so HND, MLA and equal-TP plans do not change.

Memory and time are proportional to pages × fragments, not to tokens × heads. A transport
that needs single descriptors calls :meth:`Runs.expand` (O(pieces)); one that can copy
strided pieces itself takes the runs. Pure functions, no state: any thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tspd_core.layout.contract import CacheContract
from tspd_core.layout.copies import (
    Copies,
    check_selection,
    group_copies,
    page_pairs,
)
from tspd_core.layout.manifest import BlockManifest, build_manifest
from tspd_core.layout.routes import FieldRoute, RoutePlan
from tspd_core.layout.rows import link_rows, select_rows

I64 = npt.NDArray[np.int64]
#: (src, dst, length, count, src_step, dst_step) of some runs.
Columns = tuple[I64, I64, I64, I64, I64, I64]


@dataclass(frozen=True, slots=True, eq=False)
class Runs:
    """Strided copy runs (see the module docstring): offsets from the two arena bases, all
    arrays int64 and of one length. A run with ``count == 1`` is one plain descriptor (its
    steps are then its length)."""

    src: I64
    dst: I64
    length: I64
    count: I64
    src_step: I64
    dst_step: I64
    raw_count: int  # descriptors before any coalescing (one per page, fragment row, field)

    def __len__(self) -> int:
        return int(self.src.size)

    @property
    def nbytes(self) -> int:
        """Total bytes the runs move."""
        return int(np.dot(self.length, self.count))

    @property
    def pieces(self) -> int:
        """Single descriptors the runs expand to (:meth:`expand`)."""
        return int(self.count.sum())

    @property
    def strided(self) -> bool:
        """True when some run has more than one piece."""
        return bool(self.src.size) and bool(int(self.count.max()) > 1)

    def expand(self) -> Copies:
        """One descriptor per piece, for a transport that takes single descriptors (runs in
        order, pieces in order within a run). O(pieces): only call it where needed."""
        if not self.strided:
            return Copies(self.src, self.dst, self.length, self.raw_count)
        c = int(self.count[0])
        if np.all(self.count == c):  # the usual shape: a 2-D grid, no index arrays
            j = np.arange(c, dtype=np.int64)
            src = np.multiply.outer(self.src_step, j)
            src += self.src[:, None]
            dst = np.multiply.outer(self.dst_step, j)
            dst += self.dst[:, None]
            return Copies(src.ravel(), dst.ravel(), np.repeat(self.length, c), self.raw_count)
        total = self.pieces
        starts = np.zeros(self.count.size, dtype=np.int64)
        np.cumsum(self.count[:-1], out=starts[1:])
        within = np.arange(total, dtype=np.int64) - np.repeat(starts, self.count)
        src = np.repeat(self.src, self.count) + within * np.repeat(self.src_step, self.count)
        dst = np.repeat(self.dst, self.count) + within * np.repeat(self.dst_step, self.count)
        return Copies(src, dst, np.repeat(self.length, self.count), self.raw_count)

    def take(self, lo: int, hi: int) -> Runs:
        """Runs ``lo .. hi-1`` (views, no copy); their raw count is their piece count."""
        count = self.count[lo:hi]
        return Runs(
            self.src[lo:hi],
            self.dst[lo:hi],
            self.length[lo:hi],
            count,
            self.src_step[lo:hi],
            self.dst_step[lo:hi],
            int(count.sum()),
        )

    @staticmethod
    def of(columns: Columns, raw_count: int) -> Runs:
        """Runs from their six columns."""
        src, dst, length, count, src_step, dst_step = columns
        return Runs(src, dst, length, count, src_step, dst_step, raw_count)


@dataclass(frozen=True, slots=True, eq=False)
class GroupRuns:
    """One group's fragments on one link: run ``k`` of page pair ``(s, d)`` starts at
    ``src0[k] + s·src_stride[k]`` / ``dst0[k] + d·dst_stride[k]`` (page strides)."""

    src0: I64
    dst0: I64
    src_stride: I64
    dst_stride: I64
    length: I64
    count: I64
    src_step: I64
    dst_step: I64
    layer: I64
    field: I64  # index into ``names``
    names: tuple[str, ...]

    @property
    def size(self) -> int:
        return int(self.src0.size)

    def select(
        self, layers: tuple[int, int] | None, field_ids: Collection[str] | None
    ) -> GroupRuns:
        """The fragments of the selected layers (half-open) and fields (``None`` = all);
        the selection was checked by the row table first."""
        if layers is None and field_ids is None:
            return self
        keep = np.ones(self.size, dtype=bool)
        if layers is not None:
            keep &= (self.layer >= layers[0]) & (self.layer < layers[1])
        if field_ids is not None:
            wanted = set(field_ids)
            keep &= np.isin(self.field, [i for i, n in enumerate(self.names) if n in wanted])
        return self.take(keep)

    def take(self, keep: npt.NDArray[np.bool_] | I64) -> GroupRuns:
        """The fragments ``keep`` selects (a boolean mask or indices; order as given)."""
        return GroupRuns(
            self.src0[keep],
            self.dst0[keep],
            self.src_stride[keep],
            self.dst_stride[keep],
            self.length[keep],
            self.count[keep],
            self.src_step[keep],
            self.dst_step[keep],
            self.layer[keep],
            self.field[keep],
            self.names,
        )


def link_runs(route: RoutePlan, p_rank: int, d_rank: int) -> tuple[GroupRuns | None, ...]:
    """Fragment tables of the link, one per group in group order; ``None`` for a group with
    no strided fragment (its plan is the coalescing planner's). Cached on ``route``."""
    key = ("runs", p_rank, d_rank)
    cached = route.cache.get(key)
    if cached is None:
        link = route.link(p_rank, d_rank)
        fields = link.fields if link is not None else ()
        cached = tuple(
            _group_runs(route, [f for f in fields if f.group_id == gid])
            for gid in route.p_contract.group_ids()
        )
        route.cache[key] = cached
    assert isinstance(cached, tuple)
    return cached


def _group_runs(route: RoutePlan, fields: list[FieldRoute]) -> GroupRuns | None:
    if not any(frag.rows > 1 for f in fields for frag in f.fragments):
        return None
    cols: list[list[int]] = [[] for _ in range(10)]
    for index, froute in enumerate(fields):
        pf = route.p_contract.field(froute.field_id)
        df = route.d_contract.field(froute.field_id)
        p0 = route.p_contract.page0_offset(froute.field_id)
        d0 = route.d_contract.page0_offset(froute.field_id)
        for frag in froute.fragments:
            single = frag.rows == 1
            values = (
                p0 + frag.src_offset,
                d0 + frag.dst_offset,
                pf.page_stride_bytes,
                df.page_stride_bytes,
                frag.nbytes,
                frag.rows,
                frag.nbytes if single else frag.src_stride,
                frag.nbytes if single else frag.dst_stride,
                pf.layer,
                index,
            )
            for col, value in zip(cols, values, strict=True):
                col.append(value)
    a = [np.array(c, dtype=np.int64) for c in cols]
    names = tuple(f.field_id for f in fields)
    table = GroupRuns(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], names)
    return table.take(np.argsort(table.src0, kind="stable"))


def plan_runs(
    route: RoutePlan,
    p_rank: int,
    d_rank: int,
    src_manifest: BlockManifest,
    dst_manifest: BlockManifest,
    *,
    layers: tuple[int, int] | None = None,
    field_ids: Collection[str] | None = None,
    positions: Mapping[str, tuple[int, int]] | None = None,
) -> Runs:
    """The runs P rank ``p_rank`` writes to D rank ``d_rank``: the same bytes as
    :func:`~tspd_core.layout.copies.plan_copies` with the same arguments (and the same
    checks and errors), strided fragments kept as runs. Pure; safe from many threads."""
    pairs = page_pairs(route, src_manifest, dst_manifest, positions)
    check_selection(route, field_ids)
    if route.link(p_rank, d_rank) is None:
        return _empty()
    parts: list[Columns] = []
    raw = 0
    tables = zip(
        link_rows(route, p_rank, d_rank), link_runs(route, p_rank, d_rank), pairs, strict=True
    )
    for rows_table, runs_table, (s, d) in tables:
        rows = select_rows(rows_table, layers, field_ids)
        if not rows.count or not s.size:
            continue
        raw += rows.count * int(s.size)
        if runs_table is None:
            src, dst, length = group_copies(rows, s, d)
            one = np.ones(src.size, dtype=np.int64)
            parts.append((src, dst, length, one, length, length))
        else:
            parts.append(_strided(runs_table.select(layers, field_ids), s, d))
    if not parts:
        return _empty()
    if len(parts) == 1:
        return Runs.of(parts[0], raw)
    joined = [np.concatenate([p[i] for p in parts]) for i in range(6)]
    return Runs.of((joined[0], joined[1], joined[2], joined[3], joined[4], joined[5]), raw)


def _empty() -> Runs:
    z = np.zeros(0, dtype=np.int64)
    return Runs(z, z, z, z, z, z, 0)


def _strided(t: GroupRuns, s: I64, d: I64) -> Columns:
    """Runs of one group in source order where construction gives it (fragment after
    fragment, or page after page when all of a page's fragments lie within one page stride,
    as in page-major arenas; pages in source order); a run merges into its predecessor when
    it continues it exactly on both sides.

    Fast path: when whether a run continues on the next page depends on the page ids alone
    (one fragment per page after merging a page-major page's fragments, or fragments that all
    need the same id steps) the page breaks are found once, on the ids, and only the runs
    that remain are built. Otherwise every (fragment, page) run is built and chained.
    """
    order = np.argsort(s, kind="stable")
    s, d = s[order], d[order]
    span_s, span_d = t.count * t.src_step, t.count * t.dst_step
    # Neighbouring fragments k-1 → k may chain when their pieces have one shape.
    alike = (
        (t.length[1:] == t.length[:-1])
        & (t.src_step[1:] == t.src_step[:-1])
        & (t.dst_step[1:] == t.dst_step[:-1])
    )
    page_major = _page_major(t, span_s, span_d)
    if page_major:
        one = _one_run_per_page(t, alike)
        if one is not None:
            fast = _by_page_steps(one, s, d)
            assert fast is not None, "one fragment always takes the fast path"
            return fast
    else:
        fast = _by_page_steps(t, s, d)
        if fast is not None:
            return fast
    return _chained(t, s, d, alike, span_s, span_d, page_major=page_major)


def _one_run_per_page(t: GroupRuns, alike: npt.NDArray[np.bool_]) -> GroupRuns | None:
    """A page-major page's fragments as one run, when each continues the one before."""
    span_s, span_d = t.count * t.src_step, t.count * t.dst_step
    if not bool(
        np.all(alike)
        and np.all(np.diff(t.src0) == span_s[:-1])
        and np.all(np.diff(t.dst0) == span_d[:-1])
    ):
        return None
    first = np.zeros(1, dtype=np.int64)
    merged = t.take(first)
    return dataclasses.replace(merged, count=np.array([t.count.sum()], dtype=np.int64))


def _by_page_steps(t: GroupRuns, s: I64, d: I64) -> Columns | None:
    """The fast path of :func:`_strided` for fragments in order, pages in source order, or
    ``None`` when the fragments need different id steps to continue on the next page."""
    span_s, span_d = t.count * t.src_step, t.count * t.dst_step
    # A run continues on the page whose ids are a = span/stride further on both sides (0:
    # never, as sorted distinct ids step by at least 1).
    a = np.where(span_s % t.src_stride == 0, span_s // t.src_stride, 0)
    b = np.where(span_d % t.dst_stride == 0, span_d // t.dst_stride, 0)
    if np.any(a != a[0]) or np.any(b != b[0]):
        return None
    n = int(s.size)
    breaks = np.flatnonzero((np.diff(s) != a[0]) | (np.diff(d) != b[0])) + 1
    seg = np.empty(breaks.size + 1, dtype=np.int64)
    seg[0] = 0
    seg[1:] = breaks
    pages = np.diff(seg, append=n)
    m = int(seg.size)
    src = np.multiply.outer(t.src_stride, s[seg] if m < n else s)
    src += t.src0[:, None]
    dst = np.multiply.outer(t.dst_stride, d[seg] if m < n else d)
    dst += t.dst0[:, None]
    count = np.multiply.outer(t.count, pages).ravel() if m < n else np.repeat(t.count, n)
    cols = (
        src.ravel(),
        dst.ravel(),
        np.repeat(t.length, m),
        count,
        np.repeat(t.src_step, m),
        np.repeat(t.dst_step, m),
    )
    if t.size == 1:
        return _plain(cols) if m < n else cols
    # Fragment k−1's last run may continue into fragment k's first.
    last = np.arange(1, t.size, dtype=np.int64) * m - 1
    first = last + 1
    src_o, dst_o, length, count, src_step, dst_step = cols
    join = (
        (length[first] == length[last])
        & (src_step[first] == src_step[last])
        & (dst_step[first] == dst_step[last])
        & (src_o[first] == src_o[last] + count[last] * src_step[last])
        & (dst_o[first] == dst_o[last] + count[last] * dst_step[last])
    )
    if not join.any():
        return _plain(cols) if m < n else cols
    cont = np.zeros(src_o.size, dtype=bool)
    cont[first[join]] = True
    return _merge(cols, cont)


def _merge(cols: Columns, cont: npt.NDArray[np.bool_]) -> Columns:
    """Merge runs into their predecessors where ``cont`` says they continue them."""
    starts = np.flatnonzero(~cont)
    src, dst, length, count, src_step, dst_step = cols
    merged = np.add.reduceat(count, starts)
    return _plain(
        (src[starts], dst[starts], length[starts], merged, src_step[starts], dst_step[starts])
    )


def _plain(cols: Columns) -> Columns:
    """Merged single descriptors that continue each other are one contiguous descriptor."""
    src, dst, length, count, src_step, dst_step = cols
    plain = (count > 1) & (src_step == length) & (dst_step == length)
    if not plain.any():
        return cols
    length = np.where(plain, length * count, length)
    return (
        src,
        dst,
        length,
        np.where(plain, 1, count),
        np.where(plain, length, src_step),
        np.where(plain, length, dst_step),
    )


def _chained(
    t: GroupRuns,
    s: I64,
    d: I64,
    alike: npt.NDArray[np.bool_],
    span_s: I64,
    span_d: I64,
    *,
    page_major: bool,
) -> Columns:
    """Every (fragment, page) run built, then chained (the general path of :func:`_strided`)."""
    n, r = int(s.size), t.size
    if page_major:
        src = np.add.outer(s * t.src_stride[0], t.src0)  # (pages, fragments)
        dst = np.add.outer(d * t.dst_stride[0], t.dst0)
        wraps = bool(
            t.length[-1] == t.length[0]
            and t.src_step[-1] == t.src_step[0]
            and t.dst_step[-1] == t.dst_step[0]
        )
        cont = _chain(src, dst, alike, span_s, span_d, within_page=True, wraps=wraps)
        cols = (
            src.ravel(),
            dst.ravel(),
            np.tile(t.length, n),
            np.tile(t.count, n),
            np.tile(t.src_step, n),
            np.tile(t.dst_step, n),
        )
    else:
        src = np.multiply.outer(t.src_stride, s)  # (fragments, pages)
        src += t.src0[:, None]
        dst = np.multiply.outer(t.dst_stride, d)
        dst += t.dst0[:, None]
        cont = _chain(src, dst, alike, span_s, span_d, within_page=False)
        cols = (
            src.ravel(),
            dst.ravel(),
            np.repeat(t.length, n),
            np.repeat(t.count, n),
            np.repeat(t.src_step, n),
            np.repeat(t.dst_step, n),
        )
    assert cont.size == n * r
    return _merge(cols, cont) if cont.any() else cols


def _page_major(t: GroupRuns, span_s: I64, span_d: I64) -> bool:
    """All fragments share the page strides and a page's runs fit in one stride."""
    sp, sd = int(t.src_stride[0]), int(t.dst_stride[0])
    return bool(
        np.all(t.src_stride == sp)
        and np.all(t.dst_stride == sd)
        and int((t.src0 + span_s).max() - t.src0.min()) <= sp
        and int((t.dst0 + span_d).max() - t.dst0.min()) <= sd
        and t.size > 1
    )


def _chain(
    src: I64,
    dst: I64,
    alike: npt.NDArray[np.bool_],
    span_s: I64,
    span_d: I64,
    *,
    within_page: bool,
    wraps: bool = False,
) -> npt.NDArray[np.bool_]:
    """Flat mask of the runs (in ``src``'s row-major order) that continue their predecessor.

    ``within_page``: rows are pages and columns fragments (a step along a row moves to the
    next fragment, a wrap to the next page's first, allowed when ``wraps``: the last and first
    fragments have one shape); else rows are fragments and columns
    pages (a step moves to the next page, a wrap to the next fragment's first page).
    """
    major, minor = src.shape
    cont = np.zeros((major, minor), dtype=bool)
    if minor > 1:
        if within_page:  # fragment k-1 → k of one page
            step_s, step_d, ok = span_s[:-1][None, :], span_d[:-1][None, :], alike[None, :]
        else:  # page i-1 → i of one fragment
            step_s, step_d, ok = span_s[:, None], span_d[:, None], np.ones((1, 1), bool)
        cont[:, 1:] = ok & (np.diff(src, axis=1) == step_s) & (np.diff(dst, axis=1) == step_d)
    if major > 1:
        if within_page:  # last fragment of page i-1 → first of page i
            wrap_s, wrap_d, ok_wrap = span_s[-1:], span_d[-1:], np.full(1, wraps)
        else:  # last page of fragment k-1 → first page of fragment k
            wrap_s, wrap_d, ok_wrap = span_s[:-1], span_d[:-1], alike
        cont[1:, 0] = (
            ok_wrap & (src[1:, 0] == src[:-1, -1] + wrap_s) & (dst[1:, 0] == dst[:-1, -1] + wrap_d)
        )
    return cont.ravel()


def plan_one_page(
    route: RoutePlan, p_contract: CacheContract, p_rank: int, d_contract: CacheContract, d_rank: int
) -> int:
    """Plan a one-token room (page 1 of every group on both sides) from ``p_rank`` to
    ``d_rank`` and return its descriptor count, throwing the plan away: a peer's warm-up of
    the planner's caches when a D rank registers, so that its first real room does not pay
    for them (1.7 ms cold against 0.2 ms warm for the demo's layout)."""
    src = build_manifest(p_contract, {g.group_id: [1] for g in p_contract.group_specs}, 0, 1)
    dst = build_manifest(d_contract, {g.group_id: [1] for g in d_contract.group_specs}, 0, 1)
    return len(plan_runs(route, p_rank, d_rank, src, dst).expand())
