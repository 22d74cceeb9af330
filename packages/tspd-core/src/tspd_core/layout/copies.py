"""Copy descriptors for one request between one P rank and one D rank (wire.md §6.5).

:func:`plan_copies` returns three int64 arrays — source offset (from P's arena base),
destination offset (from D's arena base) and length — built with numpy, no per-page Python
loop. Descriptors whose source and destination both continue exactly are **coalesced** into
one: across pages (consecutive block ids on both sides) and, in page-major arenas, across the
fields of a page::

    P arena   ... [pg 7: L0.k L0.v L1.k L1.v][pg 8: L0.k L0.v L1.k L1.v] ...
    D arena   ... [pg 3: L0.k L0.v L1.k L1.v][pg 4: L0.k L0.v L1.k L1.v] ...
              8 raw descriptors (4 fields × 2 pages) → 1 descriptor of 2 pages

Coalescing is maximal within a group and a stride class (rows with the same P and D page
strides): descriptors are ordered by source offset (usually already so by construction, else
sorted) and neighbours that continue on both sides with the same class are merged. The same
rule drives :mod:`tspd_core.layout.stats`, which counts the result without building it.

The per-link row tables are derived once per route and cached on it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tspd_core.layout.errors import LayoutError, ManifestError
from tspd_core.layout.manifest import BlockManifest, validate_manifest
from tspd_core.layout.routes import RoutePlan
from tspd_core.layout.rows import GroupRows, link_rows, select_rows

I64 = npt.NDArray[np.int64]
DEFAULT_BATCH = 512
#: Up to this many raw descriptors (rows × pages) a group's are built and merged in Python:
#: the numpy paths cost a few dozen calls of ~1 µs whatever the size, most of a one-page
#: request's plan (a pure function either way: the same descriptors).
FEW_DESCRIPTORS = 64


@dataclass(frozen=True, slots=True, eq=False)
class Copies:
    """Coalesced copy descriptors: ``src``/``dst`` byte offsets from the two arena bases and
    ``length`` in bytes (all int64, equal length; :func:`plan_copies` orders them by ``src``
    within each group, :meth:`~tspd_core.layout.strided.Runs.expand` keeps its runs' order)."""

    src: I64
    dst: I64
    length: I64
    raw_count: int  # descriptors before coalescing (one per page, fragment row and field)

    def __len__(self) -> int:
        return int(self.src.size)

    @property
    def nbytes(self) -> int:
        """Total bytes the descriptors move."""
        return int(self.length.sum())

    def absolute(self, src_base: int, dst_base: int) -> tuple[I64, I64, I64]:
        """Absolute (src, dst, length) arrays for a transfer engine, given the arena bases."""
        return self.src + np.int64(src_base), self.dst + np.int64(dst_base), self.length


def iter_batches(copies: Copies, max_descriptors: int = DEFAULT_BATCH) -> Iterator[Copies]:
    """Consecutive slices of at most ``max_descriptors`` descriptors (views, no copy).

    Mooncake's TCP lanes refuse very large batches; 512 per call is safe.
    """
    if max_descriptors < 1:
        raise LayoutError(f"max_descriptors must be ≥ 1, got {max_descriptors}")
    for lo in range(0, len(copies), max_descriptors):
        hi = min(lo + max_descriptors, len(copies))
        # A batch's descriptors are already coalesced: its raw count is its own length.
        yield Copies(copies.src[lo:hi], copies.dst[lo:hi], copies.length[lo:hi], hi - lo)


def _check_pair(route: RoutePlan, src: BlockManifest, dst: BlockManifest) -> None:
    validate_manifest(src, route.p_contract)
    validate_manifest(dst, route.d_contract)
    if (src.prefix_len, src.prompt_len) != (dst.prefix_len, dst.prompt_len):
        raise ManifestError(
            f"source manifest lengths (prefix {src.prefix_len}, prompt {src.prompt_len}) differ "
            f"from the destination's (prefix {dst.prefix_len}, prompt {dst.prompt_len}); P must "
            "build its source manifest with D's two lengths"
        )


def page_pairs(
    route: RoutePlan,
    src: BlockManifest,
    dst: BlockManifest,
    positions: Mapping[str, tuple[int, int]] | None,
) -> list[tuple[I64, I64]]:
    """Validated (P ids, D ids) per group, cut to ``positions`` (see :func:`plan_copies`)."""
    _check_pair(route, src, dst)
    gids = route.p_contract.group_ids()
    if positions is not None and set(positions) != set(gids):
        raise LayoutError(
            f"positions must name every group exactly: missing "
            f"{sorted(set(gids) - set(positions))}, unknown {sorted(set(positions) - set(gids))}"
        )
    out = []
    for gid in gids:
        s, d = src.block_ids(gid), dst.block_ids(gid)
        if positions is not None:
            lo, hi = positions[gid]
            if not 0 <= lo <= hi <= s.size:
                raise LayoutError(f"positions[{gid!r}] = ({lo}, {hi}) is outside 0..{s.size}")
            s, d = s[lo:hi], d[lo:hi]
        out.append((s, d))
    return out


def plan_copies(
    route: RoutePlan,
    p_rank: int,
    d_rank: int,
    src_manifest: BlockManifest,
    dst_manifest: BlockManifest,
    *,
    layers: tuple[int, int] | None = None,
    field_ids: Collection[str] | None = None,
    positions: Mapping[str, tuple[int, int]] | None = None,
) -> Copies:
    """The coalesced descriptors P rank ``p_rank`` writes to D rank ``d_rank`` for a request.

    ``src_manifest`` holds P's page ids, ``dst_manifest`` D's, each validated against its
    side's contract (:class:`ManifestError`). Optional selections, for layerwise streaming and
    chunked prefill: ``layers`` — a half-open merged-layer interval; ``field_ids`` — only these
    fields; ``positions`` — per group (every group must be named) a half-open interval of
    manifest positions, e.g. from :func:`~tspd_core.layout.manifest.chunk_positions`.
    A pair with no route (a dummy P rank, a D rank it does not serve) gets no descriptors.
    Pure function of its inputs; safe to call from many threads.
    """
    pairs = page_pairs(route, src_manifest, dst_manifest, positions)
    check_selection(route, field_ids)
    if route.link(p_rank, d_rank) is None:
        return _empty()
    parts: list[tuple[I64, I64, I64]] = []
    raw = 0
    for table, (s, d) in zip(link_rows(route, p_rank, d_rank), pairs, strict=True):
        rows = select_rows(table, layers, field_ids)
        if rows.count and s.size:
            raw += rows.count * int(s.size)
            parts.append(group_copies(rows, s, d))
    if not parts:
        return _empty()
    if len(parts) == 1:
        return Copies(*parts[0], raw)
    src, dst, length = (np.concatenate([p[i] for p in parts]) for i in range(3))
    return Copies(src, dst, length, raw)


def check_selection(route: RoutePlan, field_ids: Collection[str] | None) -> None:
    """Unknown field ids in a selection are a caller bug: say so rather than send nothing."""
    if field_ids is None:
        return
    if isinstance(field_ids, str):
        raise LayoutError("field_ids must be a collection of field ids, not one string")
    unknown = sorted(set(field_ids) - {f.field_id for f in route.p_contract.plan.fields})
    if unknown:
        raise LayoutError(f"field_ids names fields the contract does not have: {unknown[:4]}")


def _empty() -> Copies:
    z = np.zeros(0, dtype=np.int64)
    return Copies(z, z, z, 0)


def group_copies(rows: GroupRows, s: I64, d: I64) -> tuple[I64, I64, I64]:
    """Coalesced descriptors of one group, in source order.

    In the two common layouts the raw descriptors are source-sorted by construction (row
    after row, or page after page), so which neighbours continue is known from the rows and
    the page ids alone: a boolean mask marks the joins and only run starts and ends are ever
    computed. Mixed layouts (token-major pages: several rows per plane) are cut into blocks of
    rows that each fit one page stride, handled page after page. Anything else builds every
    descriptor, sorts by source and merges.
    """
    if rows.count * s.size <= FEW_DESCRIPTORS:
        return _few(rows, s, d)
    order = np.argsort(s, kind="stable")
    s, d = s[order], d[order]
    if _row_major_sorted(rows, s):
        return _row_major(rows, s, d)
    if _page_major_sorted(rows):
        return _page_major(rows, s, d)
    blocks = _plane_blocks(rows, s)
    if blocks is not None:
        return _blocked(rows, s, d, blocks)
    return _sorted_merge(rows, s, d)


def _few(rows: GroupRows, s: I64, d: I64) -> tuple[I64, I64, I64]:
    """:func:`_sorted_merge` in Python, for a few descriptors: every raw descriptor in source
    order, merged with its predecessor when both sides continue in the same stride class."""
    src0, src_stride, dst0 = rows.src0.tolist(), rows.src_stride.tolist(), rows.dst0.tolist()
    dst_stride, length, cls = rows.dst_stride.tolist(), rows.length.tolist(), rows.cls.tolist()
    pairs = list(zip(s.tolist(), d.tolist(), strict=True))
    raw = sorted(
        (src0[k] + src_stride[k] * p, dst0[k] + dst_stride[k] * q, length[k], cls[k])
        for k in range(len(src0))
        for p, q in pairs
    )
    out_src: list[int] = []
    out_dst: list[int] = []
    out_len: list[int] = []
    last_cls = None
    for src, dst, n, c in raw:
        if (
            out_len
            and c == last_cls
            and src == out_src[-1] + out_len[-1]
            and (dst == out_dst[-1] + out_len[-1])
        ):
            out_len[-1] += n
            continue
        out_src.append(src)
        out_dst.append(dst)
        out_len.append(n)
        last_cls = c
    as64 = np.int64
    return np.array(out_src, as64), np.array(out_dst, as64), np.array(out_len, as64)


def _row_major(rows: GroupRows, s: I64, d: I64) -> tuple[I64, I64, I64]:
    n, r = int(s.size), rows.count
    # A row's run continues into the next page iff the ids step by one on both sides and the
    # run covers the whole page stride on both sides (runs never exceed their stride).
    whole = (rows.length == rows.src_stride) & (rows.length == rows.dst_stride)
    step = (np.diff(s) == 1) & (np.diff(d) == 1)
    cont = np.empty((r, n), dtype=bool)
    cont[:, 1:] = whole[:, None] & step[None, :]
    cont[0, 0] = False
    if r > 1:  # the last page of row k−1 may continue into the first page of row k
        lead = rows.length[:-1]
        cont[1:, 0] = (
            (
                rows.src0[:-1] + rows.src_stride[:-1] * s[-1] + lead
                == rows.src0[1:] + rows.src_stride[1:] * s[0]
            )
            & (
                rows.dst0[:-1] + rows.dst_stride[:-1] * d[-1] + lead
                == rows.dst0[1:] + rows.dst_stride[1:] * d[0]
            )
            & (rows.cls[1:] == rows.cls[:-1])
        )

    def at(idx: I64 | None) -> tuple[I64, I64, I64]:
        if idx is None:
            src = _by_row(rows.src_stride, s, rows.src0)
            return src, _by_row(rows.dst_stride, d, rows.dst0), np.repeat(rows.length, n)
        k, i = np.divmod(idx, n)
        return (
            rows.src0[k] + rows.src_stride[k] * s[i],
            rows.dst0[k] + rows.dst_stride[k] * d[i],
            rows.length[k],
        )

    return _runs(cont.ravel(), at)


def _page_major(rows: GroupRows, s: I64, d: I64) -> tuple[I64, I64, I64]:
    n, r = int(s.size), rows.count
    sp, sd = rows.src_stride[0], rows.dst_stride[0]
    src_span = rows.src0[-1] + rows.length[-1] - rows.src0[0]
    dst_span = rows.dst0[-1] + rows.length[-1] - rows.dst0[0]
    cont = np.empty((n, r), dtype=bool)
    cont[:, 1:] = (
        (rows.src0[:-1] + rows.length[:-1] == rows.src0[1:])
        & (rows.dst0[:-1] + rows.length[:-1] == rows.dst0[1:])
    )[None, :]
    cont[0, 0] = False
    cont[1:, 0] = (np.diff(s) * sp == src_span) & (np.diff(d) * sd == dst_span)

    def at(idx: I64 | None) -> tuple[I64, I64, I64]:
        if idx is None:
            src = _by_page(s, sp, rows.src0)
            return src, _by_page(d, sd, rows.dst0), np.tile(rows.length, n)
        i, k = np.divmod(idx, r)
        return s[i] * sp + rows.src0[k], d[i] * sd + rows.dst0[k], rows.length[k]

    return _runs(cont.ravel(), at)


def _by_row(stride: I64, pages: I64, base: I64) -> I64:
    """``base[k] + stride[k] · pages[i]`` in row-major order, built in place."""
    out = np.multiply.outer(stride, pages)
    out += base[:, None]
    return out.ravel()


def _by_page(pages: I64, stride: np.int64, base: I64) -> I64:
    """``pages[i] · stride + base[k]`` in page-major order, built in place."""
    out = np.empty((pages.size, base.size), dtype=np.int64)
    out[:] = base[None, :]
    out += (pages * stride)[:, None]
    return out.ravel()


def _runs(
    cont: npt.NDArray[np.bool_], at: Callable[[I64 | None], tuple[I64, I64, I64]]
) -> tuple[I64, I64, I64]:
    """Runs of source-ordered descriptors given which ones continue their predecessor;
    ``at(idx)`` computes descriptors at flat indices (``None``: all of them)."""
    if not cont.any():
        return at(None)
    starts = np.flatnonzero(~cont)
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:] - 1
    ends[-1] = cont.size - 1
    src, dst, _ = at(starts)
    last_src, _, last_len = at(ends)
    return src, dst, last_src + last_len - src


def _plane_blocks(rows: GroupRows, s: I64) -> list[tuple[int, int]] | None:
    """Consecutive row slices that each fit one page stride of one class, or ``None`` when
    the slices' descriptor ranges interleave (then only a sort orders them)."""
    src0, length = rows.src0.tolist(), rows.length.tolist()
    stride, cls = rows.src_stride.tolist(), rows.cls.tolist()
    blocks, lo = [], 0
    for k in range(1, rows.count):
        if cls[k] != cls[lo] or src0[k] + length[k] - src0[lo] > stride[lo]:
            blocks.append((lo, k))
            lo = k
    blocks.append((lo, rows.count))
    first, last = int(s[0]), int(s[-1])
    for (a, b), (c, _) in itertools.pairwise(blocks):
        if src0[b - 1] + stride[a] * last + length[b - 1] > src0[c] + stride[c] * first:
            return None
    return blocks


def _blocked(
    rows: GroupRows, s: I64, d: I64, blocks: list[tuple[int, int]]
) -> tuple[I64, I64, I64]:
    parts = [_page_major(rows.take(slice(a, b)), s, d) for a, b in blocks]
    src, dst, length = (np.concatenate([p[i] for p in parts]) for i in range(3))
    # Runs may still join across block boundaries (same class only): check just those.
    at = np.cumsum([p[0].size for p in parts[:-1]], dtype=np.int64)
    same_cls = np.array(
        [rows.cls[a] == rows.cls[c] for (a, _), (c, _) in itertools.pairwise(blocks)], dtype=bool
    )
    joins = at[
        same_cls
        & (src[at] == src[at - 1] + length[at - 1])
        & (dst[at] == dst[at - 1] + length[at - 1])
    ]
    if joins.size == 0:
        return src, dst, length
    same = np.zeros(src.size, dtype=bool)
    same[joins] = True
    return merge_runs(src, dst, length, same)


def _sorted_merge(rows: GroupRows, s: I64, d: I64) -> tuple[I64, I64, I64]:
    n = int(s.size)
    src = (rows.src0[:, None] + rows.src_stride[:, None] * s[None, :]).ravel()
    dst = (rows.dst0[:, None] + rows.dst_stride[:, None] * d[None, :]).ravel()
    length = np.repeat(rows.length, n)
    cls = np.repeat(rows.cls, n)
    by_src = np.argsort(src, kind="stable")
    src, dst, length, cls = src[by_src], dst[by_src], length[by_src], cls[by_src]
    same = np.concatenate(([False], cls[1:] == cls[:-1]))
    return merge_runs(src, dst, length, same)


def _row_major_sorted(rows: GroupRows, s: I64) -> bool:
    """Row after row is source-sorted iff each row's last page ends before the next row's
    first page (rows are sorted by page-0 offset; ``s`` ascending)."""
    if rows.count == 1:
        return True
    first = rows.src0 + rows.src_stride * s[0]
    end = rows.src0 + rows.src_stride * s[-1] + rows.length
    return bool(np.all(end[:-1] <= first[1:]))


def _page_major_sorted(rows: GroupRows) -> bool:
    """Page after page is source-sorted iff all rows share one class and fit in one stride."""
    stride = int(rows.src_stride[0])
    return bool(
        np.all(rows.cls == rows.cls[0])
        and int(rows.src0[-1] + rows.length[-1] - rows.src0[0]) <= stride
    )


def merge_runs(
    src: I64, dst: I64, length: I64, same: npt.NDArray[np.bool_]
) -> tuple[I64, I64, I64]:
    """Merge source-ordered descriptors that continue on both sides (``same`` marks
    descriptors in the same class as their predecessor)."""
    if src.size == 0:
        return src, dst, length
    cont = same.copy()
    cont[0] = False
    cont[1:] &= src[1:] == src[:-1] + length[:-1]
    cont[1:] &= dst[1:] == dst[:-1] + length[:-1]
    starts = np.flatnonzero(~cont)
    if starts.size == src.size:
        return src, dst, length
    return src[starts], dst[starts], np.add.reduceat(length, starts)
