"""Block manifests (wire.md §5): which pages one request occupies on one side.

A manifest lists, per group in ``group_specs`` order, the page ids of the slots the group's
transfer policy moves, plus ``prefix_len`` (tokens D already holds) and ``prompt_len``. D sends
its destination manifest in the pre-allocation; P builds its source manifest from its own block
tables with D's two lengths and copies source id ``i`` to destination id ``i`` per group.

Manifests are immutable values (their id arrays are read-only), safe to share across threads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tspd_core.layout.contract import CacheContract, GroupSpec, Retention, TransferPolicy
from tspd_core.layout.errors import ManifestError

IdArray = npt.NDArray[np.int64]


def _frozen_ids(ids: npt.ArrayLike, where: str) -> IdArray:
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ManifestError(f"{where}: block ids must be a 1-D integer array, got {arr.dtype}")
    out = np.array(arr, dtype=np.int64, copy=True)
    out.flags.writeable = False
    return out


@dataclass(frozen=True, slots=True, eq=False)
class GroupBlocks:
    """One group's page ids, in slot order."""

    group_id: str
    block_ids: IdArray

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", _frozen_ids(self.block_ids, self.group_id))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GroupBlocks):
            return NotImplemented
        return self.group_id == other.group_id and np.array_equal(self.block_ids, other.block_ids)

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, slots=True, eq=False)
class BlockManifest:
    """The pages of one request on one side (wire.md §5). Not validated until checked against a
    contract with :func:`validate_manifest`."""

    groups: tuple[GroupBlocks, ...]
    prefix_len: int
    prompt_len: int

    def block_ids(self, group_id: str) -> IdArray:
        """The page ids of ``group_id``."""
        for g in self.groups:
            if g.group_id == group_id:
                return g.block_ids
        raise ManifestError(f"manifest has no group {group_id!r}")

    def page_count(self) -> int:
        """Total number of pages over all groups."""
        return sum(int(g.block_ids.size) for g in self.groups)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockManifest):
            return NotImplemented
        return (self.groups, self.prefix_len, self.prompt_len) == (
            other.groups,
            other.prefix_len,
            other.prompt_len,
        )

    __hash__ = None  # type: ignore[assignment]


def slot_range(spec: GroupSpec, prefix_len: int, prompt_len: int) -> range:
    """The block-table slots a group's policy moves (wire.md §5).

    ``full_suffix``: ``prefix_len//G … ceil(prompt_len/G)−1``, starting no earlier than
    ``max(0, prompt_len − window + 1)//G`` for sliding-window groups; ``latest_snapshot``:
    only ``(prompt_len−1)//G``.
    """
    g = spec.block_granularity
    if spec.transfer_policy is None:
        raise ManifestError(
            f"group {spec.group_id!r} has no transfer_policy (PD is off for it); the contract "
            "must set full_suffix or latest_snapshot"
        )
    if spec.transfer_policy == TransferPolicy.LATEST_SNAPSHOT:
        last = (prompt_len - 1) // g
        return range(last, last + 1)
    begin = prefix_len // g
    if spec.retention == Retention.SLIDING_WINDOW:
        assert spec.sliding_window_tokens is not None, "validated sliding group has a window"
        begin = max(begin, max(0, prompt_len - spec.sliding_window_tokens + 1) // g)
    return range(begin, -(-prompt_len // g))


def check_lengths(contract: CacheContract, prefix_len: object, prompt_len: object) -> None:
    """``0 ≤ prefix_len < prompt_len`` and ``prefix_len`` on a prefix-granularity boundary."""
    for name, value in (("prefix_len", prefix_len), ("prompt_len", prompt_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ManifestError(f"manifest {name}: expected an integer ≥ 0, got {value!r}")
    assert isinstance(prefix_len, int)
    assert isinstance(prompt_len, int)
    if prefix_len >= prompt_len:
        raise ManifestError(
            f"manifest: prefix_len {prefix_len} must be < prompt_len {prompt_len} "
            "(D must leave at least the last prompt token to receive)"
        )
    granularity = contract.plan.prefix_granularity
    if prefix_len % granularity:
        raise ManifestError(
            f"manifest: prefix_len {prefix_len} is not a multiple of the prefix granularity "
            f"{granularity}; round the prefix hit down to a whole block"
        )


def validate_manifest(manifest: BlockManifest, contract: CacheContract) -> None:
    """Check ``manifest`` against ``contract`` (wire.md §5); raise :class:`ManifestError`.

    Valid iff the lengths are consistent, groups come in ``group_specs`` order, each group
    has exactly one id per slot of its policy, and every id is a real, distinct page
    (``1 .. page_count−1``; 0 is the null page).
    """
    check_lengths(contract, manifest.prefix_len, manifest.prompt_len)
    want = contract.group_ids()
    have = tuple(g.group_id for g in manifest.groups)
    if have != want:
        raise ManifestError(f"manifest groups {list(have)} must be {list(want)} (in this order)")
    for entry in manifest.groups:
        spec = contract.spec(entry.group_id)
        slots = slot_range(spec, manifest.prefix_len, manifest.prompt_len)
        _check_ids(
            entry.group_id, entry.block_ids, slots, contract.group(entry.group_id).page_count
        )


def _check_ids(group_id: str, ids: IdArray, slots: range, page_count: int) -> None:
    where = f"manifest group {group_id!r}"
    if ids.size != len(slots):
        raise ManifestError(
            f"{where}: has {ids.size} block ids but its policy moves {len(slots)} slots "
            f"({slots.start}..{slots.stop - 1})"
        )
    bad = np.flatnonzero((ids < 1) | (ids >= page_count))
    if bad.size:
        i = int(bad[0])
        what = "the null page" if ids[i] == 0 else f"outside 1..{page_count - 1}"
        raise ManifestError(f"{where}: block id {int(ids[i])} at position {i} is {what}")
    if ids.size > 1:
        order = np.argsort(ids, kind="stable")
        dup = np.flatnonzero(ids[order][1:] == ids[order][:-1])
        if dup.size:
            a, b = int(order[dup[0]]), int(order[dup[0] + 1])
            raise ManifestError(
                f"{where}: block id {int(ids[a])} appears at positions {a} and {b}; "
                "each slot needs its own page"
            )


def build_manifest(
    contract: CacheContract,
    tables: Mapping[str, npt.ArrayLike],
    prefix_len: int,
    prompt_len: int,
) -> BlockManifest:
    """Select each group's pages from its block-table row (slot → page id) by policy.

    ``tables`` maps exactly the contract's group ids to that request's block-table rows;
    entries outside the policy's slots are ignored (they may be 0). Raises
    :class:`ManifestError` when the group ids disagree (a table for a group the contract does
    not have means the scheduler and the arena disagree: TokenSpeed refuses it too), a row
    is too short, or a selected id is invalid.
    """
    check_lengths(contract, prefix_len, prompt_len)
    want = set(contract.group_ids())
    if set(tables) != want:
        raise ManifestError(
            "build_manifest: block-table group IDs disagree with the contract: missing "
            f"{sorted(want - set(tables))}, extra {sorted(set(tables) - want)}"
        )
    groups = []
    for spec in contract.group_specs:
        row = np.asarray(tables[spec.group_id])
        slots = slot_range(spec, prefix_len, prompt_len)
        if row.ndim != 1 or row.shape[0] < slots.stop:
            raise ManifestError(
                f"build_manifest: block table of group {spec.group_id!r} has shape "
                f"{row.shape} but slot {slots.stop - 1} is needed"
            )
        groups.append(GroupBlocks(spec.group_id, row[slots.start : slots.stop]))
    manifest = BlockManifest(tuple(groups), prefix_len, prompt_len)
    validate_manifest(manifest, contract)
    return manifest


def chunk_positions(
    contract: CacheContract,
    manifest: BlockManifest,
    chunk_start: int,
    chunk_end: int,
    *,
    first: bool,
) -> dict[str, tuple[int, int]]:
    """Manifest positions ``[start, stop)`` per group that one prefill chunk makes ready.

    wire.md §7: a ``full_suffix`` group with first slot ``slot0`` and ``n`` pages selects
    ``[cs//G − slot0, R − slot0)`` clamped to ``[0, n]``, with ``R = ceil(ce/G)`` on the final
    chunk (``ce == prompt_len``) else ``ce//G``; the first chunk lowers ``cs`` to
    ``prefix_len``. ``latest_snapshot`` groups select position 0 on the final chunk only.
    The result feeds ``plan_copies(..., positions=...)``.
    """
    if not 0 <= chunk_start < chunk_end <= manifest.prompt_len:
        raise ManifestError(
            f"chunk [{chunk_start}, {chunk_end}) must satisfy 0 ≤ start < end ≤ prompt_len "
            f"{manifest.prompt_len}"
        )
    final = chunk_end == manifest.prompt_len
    start_tok = min(chunk_start, manifest.prefix_len) if first else chunk_start
    out: dict[str, tuple[int, int]] = {}
    for spec in contract.group_specs:
        n = int(manifest.block_ids(spec.group_id).size)
        if spec.transfer_policy == TransferPolicy.LATEST_SNAPSHOT:
            out[spec.group_id] = (0, 1) if final else (0, 0)
            continue
        g = spec.block_granularity
        slot0 = slot_range(spec, manifest.prefix_len, manifest.prompt_len).start
        ready = -(-chunk_end // g) if final else chunk_end // g
        lo = min(max(start_tok // g - slot0, 0), n)
        hi = min(max(ready - slot0, lo), n)
        out[spec.group_id] = (lo, hi)
    return out
