"""Exact transfer sizes without building descriptors (for the simulator).

:func:`transfer_stats` returns the bytes, the raw descriptor count and the coalesced
descriptor count that :func:`~tspd_core.layout.copies.plan_copies` would produce, in
O(rows) once per link and O(pages · log pages) per request.

Why it is exact: within a group, descriptors never share source bytes, so each has at most
one *successor* — the descriptor starting where it ends. Coalescing merges a descriptor with
its successor iff the destination continues too and both rows share a stride class, and the
coalesced count is ``raw − merges``. For rows ``k → k'`` of one class (P stride σP, D stride
σD) the pair merges on page pairs ``(i, j)`` with ``s_j − s_i = δs`` and ``d_j − d_i = δd``
where ``δs = (src0_k + len_k − src0_k') / σP`` and ``δd`` likewise — integers only when the
residues match. The (δs, δd, multiplicity) list depends on the link alone (its *profile*);
a request only counts page pairs at each offset, e.g. (0, 0) → every page (fields side by
side) and (1, 1) → consecutive block ids on both sides.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tspd_core.ids import Rank
from tspd_core.layout.copies import check_selection, page_pairs
from tspd_core.layout.manifest import BlockManifest
from tspd_core.layout.routes import RoutePlan
from tspd_core.layout.rows import GroupRows, link_rows, select_rows

I64 = npt.NDArray[np.int64]
_SHIFT = np.int64(1 << 32)


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one link moves for one request: exactly what ``plan_copies`` would build."""

    nbytes: int
    descriptors: int  # after coalescing
    raw_descriptors: int  # one per page, fragment row and field


@dataclass(frozen=True, slots=True)
class GroupProfile:
    """Request-independent counts of one group on one link."""

    rows: int
    bytes_per_page: int
    deltas: tuple[tuple[int, int, int], ...]  # (δs, δd, multiplicity)


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """Per-group profiles of one link (and one layer/field selection), in group order."""

    groups: tuple[GroupProfile, ...]

    def stats(self, src_ids: Sequence[I64], dst_ids: Sequence[I64]) -> TransferStats:
        """Stats for per-group P and D page-id arrays (position ``i`` copies to ``i``).

        The caller guarantees what manifest validation checks (equal lengths, distinct ids);
        :func:`transfer_stats` does so from manifests.
        """
        return self.count([PairCounter(s, d) for s, d in zip(src_ids, dst_ids, strict=True)])

    def count(self, counters: Sequence[PairCounter]) -> TransferStats:
        """Stats from per-group :class:`PairCounter` objects (shareable across links)."""
        nbytes = raw = merges = 0
        for prof, counter in zip(self.groups, counters, strict=True):
            n = int(counter.s.size)
            if not n or not prof.rows:
                continue
            nbytes += prof.bytes_per_page * n
            raw += prof.rows * n
            merges += sum(mult * counter.pairs(ds, dd) for ds, dd, mult in prof.deltas)
        return TransferStats(nbytes, raw - merges, raw)


class PairCounter:
    """Counts positions ``i`` that have a ``j`` with ``(s_j, d_j) = (s_i + δs, d_i + δd)``
    for one group's page-id arrays; answers are memoized, so one counter serves every link
    of a route (all ranks of a replica share one block table).

    Offsets wider than the spread of the ids (``|δs| > max(s) − min(s)``, likewise δd) cannot
    match and count 0 without a search: a per-field arena has one such offset per pair of
    adjacent planes (a plane's last page into the next plane's first), and a request's pages
    rarely span a whole plane.
    """

    def __init__(self, s: I64, d: I64) -> None:
        self.s, self.d = s, d
        self._memo: dict[tuple[int, int], int] = {}
        self._keys: I64 | None = None
        self._by_s: tuple[I64, I64] | None = None
        self._spans: tuple[int, int] | None = None

    def pairs(self, ds: int, dd: int) -> int:
        """The number of such positions ``i``."""
        if (ds, dd) not in self._memo:
            self._memo[(ds, dd)] = self._pairs(ds, dd)
        return self._memo[(ds, dd)]

    def _pairs(self, ds: int, dd: int) -> int:
        if ds == 0 and dd == 0:
            return int(self.s.size)
        if ds == 1:
            # Distinct ids: s_j = s_i + 1 can only be the next id in ascending order.
            s, d = self._ascending()
            return int(np.count_nonzero((s[1:] - s[:-1] == 1) & (d[1:] - d[:-1] == dd)))
        if self._spans is None:
            s, d = self.s, self.d
            self._spans = (
                (int(s.max()) - int(s.min()), int(d.max()) - int(d.min())) if s.size else (-1, -1)
            )
        if abs(ds) > self._spans[0] or abs(dd) > self._spans[1]:
            return 0
        # Packing (s, d) into one int64 key needs both below 2**31 (always true in practice).
        if max(int(self.s.max()), int(self.d.max())) >= 1 << 31:
            have = set(zip(self.s.tolist(), self.d.tolist(), strict=True))
            return sum((a + ds, b + dd) in have for a, b in have)
        if self._keys is None:
            self._keys = np.sort(self.s * _SHIFT + self.d)
        want = self.d + dd
        query = (self.s + ds) * _SHIFT + want
        idx = np.searchsorted(self._keys, query).clip(max=self._keys.size - 1)
        return int(np.count_nonzero((self._keys[idx] == query) & (want >= 0)))

    def _ascending(self) -> tuple[I64, I64]:
        # (s, d) ordered by s; no copy when s already ascends (fresh pools allocate in order).
        if self._by_s is None:
            s, d = self.s, self.d
            if not np.count_nonzero(s[1:] <= s[:-1]):
                self._by_s = (s, d)
            else:
                order = np.argsort(s)
                self._by_s = (s[order], d[order])
        return self._by_s


def group_profile(rows: GroupRows, p_pages: int, d_pages: int) -> GroupProfile:
    """The (δs, δd) merge offsets of one group's rows (see module docstring).

    Offsets no two pages of the groups can have are dropped up front: block ids lie in
    ``1 .. pages - 1`` (page 0 is the null page), so ``|δs| ≥ p_pages - 1`` or
    ``|δd| ≥ d_pages - 1`` never matches — e.g. from one plane's last page into the next
    plane's first, one offset per pair of adjacent planes of a per-field arena.
    """
    starts: dict[tuple[int, int, int], list[int]] = {}
    src0, dst0 = rows.src0.tolist(), rows.dst0.tolist()
    sp, sd, cls = rows.src_stride.tolist(), rows.dst_stride.tolist(), rows.cls.tolist()
    for k in range(rows.count):
        starts.setdefault((cls[k], src0[k] % sp[k], dst0[k] % sd[k]), []).append(k)
    index = {key: np.array(ks, dtype=np.int64) for key, ks in starts.items()}
    deltas: Counter[tuple[int, int]] = Counter()
    for k in range(rows.count):
        src_end = src0[k] + int(rows.length[k])
        dst_end = dst0[k] + int(rows.length[k])
        cand = index.get((cls[k], src_end % sp[k], dst_end % sd[k]))
        if cand is None:
            continue
        ds = (src_end - rows.src0[cand]) // sp[k]
        dd = (dst_end - rows.dst0[cand]) // sd[k]
        near = (np.abs(ds) < p_pages - 1) & (np.abs(dd) < d_pages - 1)
        deltas.update(zip(ds[near].tolist(), dd[near].tolist(), strict=True))
    return GroupProfile(
        rows=rows.count,
        bytes_per_page=int(rows.length.sum()),
        deltas=tuple((ds, dd, m) for (ds, dd), m in sorted(deltas.items())),
    )


def link_profile(
    route: RoutePlan,
    p_rank: int,
    d_rank: int,
    *,
    layers: tuple[int, int] | None = None,
    field_ids: Collection[str] | None = None,
) -> LinkProfile:
    """The link's profile for a layer/field selection (cached on ``route``)."""
    check_selection(route, field_ids)
    key = ("profile", p_rank, d_rank, layers, None if field_ids is None else frozenset(field_ids))
    cached = route.cache.get(key)
    if cached is None:
        tables = link_rows(route, p_rank, d_rank)
        cached = LinkProfile(
            tuple(
                group_profile(
                    select_rows(t, layers, field_ids),
                    route.p_contract.group(t.group_id).page_count,
                    route.d_contract.group(t.group_id).page_count,
                )
                for t in tables
            )
        )
        route.cache[key] = cached
    assert isinstance(cached, LinkProfile)
    return cached


def transfer_stats(
    route: RoutePlan,
    p_rank: int,
    d_rank: int,
    src_manifest: BlockManifest,
    dst_manifest: BlockManifest,
    *,
    layers: tuple[int, int] | None = None,
    field_ids: Collection[str] | None = None,
    positions: Mapping[str, tuple[int, int]] | None = None,
) -> TransferStats:
    """Bytes and descriptor counts ``plan_copies`` would produce for the same arguments."""
    pairs = page_pairs(route, src_manifest, dst_manifest, positions)
    profile = link_profile(route, p_rank, d_rank, layers=layers, field_ids=field_ids)
    return profile.stats([s for s, _ in pairs], [d for _, d in pairs])


def route_stats(
    route: RoutePlan,
    src_manifest: BlockManifest,
    dst_manifest: BlockManifest,
    *,
    layers: tuple[int, int] | None = None,
    field_ids: Collection[str] | None = None,
    positions: Mapping[str, tuple[int, int]] | None = None,
) -> dict[tuple[Rank, Rank], TransferStats]:
    """:func:`transfer_stats` for every link of the route (every rank of a replica shares
    one block table, so one manifest pair serves all links); manifests checked once."""
    counters = [
        PairCounter(s, d) for s, d in page_pairs(route, src_manifest, dst_manifest, positions)
    ]
    return {
        link: link_profile(route, *link, layers=layers, field_ids=field_ids).count(counters)
        for link in route.links
    }
