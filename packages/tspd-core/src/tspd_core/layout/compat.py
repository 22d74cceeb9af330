"""Peer contract validation (wire.md §4 "must match" / "may differ").

Both P and D run :func:`check_compatible` on the other's contract before planning a route.
What must match is semantics: prefix granularity, group order and group specs, each group's
field ids, and per field its dtype, partition and global shape (at equal TP also its local
shape). Capacities, planes, offsets, strides, the local extent of a partitioned axis and the
order of ``plan.fields`` may differ.
"""

from __future__ import annotations

from tspd_core.layout.contract import CacheContract, Partition
from tspd_core.layout.errors import ContractMismatch

_SPEC_ATTRS = (
    "family",
    "rows_per_page",
    "entry_stride_tokens",
    "checkpoint_granularity",
    "retention",
    "sliding_window_tokens",
    "transfer_policy",
)


def _show(value: object) -> str:
    if isinstance(value, Partition):
        return f"axis {value.axis} extent {value.global_extent} parts {list(value.global_parts)}"
    if value is None:
        return "null"
    if isinstance(value, tuple):
        return str(list(value))
    return str(getattr(value, "value", value))


#: K/V pages split over heads on axis 1 are token-major (NHD), on axis 0 head-major (HND).
_ORDERS = {0: "head-major (HND)", 1: "token-major (NHD)"}


def _page_order_hint(suffix: str, a: Partition | None, b: Partition | None) -> str | None:
    """The one-line fix when two K/V fields differ only in page order: the flag to start with.

    TokenSpeed has token-major pages only, so a tspd node that must pair with it runs NHD.
    """
    if suffix not in ("k", "v") or a is None or b is None:
        return None
    if {a.axis, b.axis} != {0, 1} or (a.global_extent, a.parts) != (b.global_extent, b.parts):
        return None
    return (
        f"the K/V page orders differ ({_ORDERS[a.axis]} vs {_ORDERS[b.axis]}): start the tspd "
        "node with --page-layout nhd (token-major, the only order TokenSpeed has, and tspd's "
        "default) or both with --page-layout hnd"
    )


def check_compatible(
    ours: CacheContract,
    theirs: CacheContract,
    *,
    our_tp: int | None = None,
    their_tp: int | None = None,
    labels: tuple[str, str] = ("ours", "peer"),
) -> None:
    """Raise :class:`ContractMismatch` naming the first property that must match but differs.

    ``our_tp``/``their_tp`` (attention TP sizes) enable the equal-TP local-shape rule. The
    check is symmetric apart from the ``labels`` the message gives the two sides.
    """
    try:
        _check(ours, theirs, our_tp == their_tp and our_tp is not None)
    except ContractMismatch as exc:
        if labels == ("ours", "peer"):
            raise
        raise ContractMismatch(exc.path, exc.ours, exc.theirs, labels, exc.hint) from None


def _check(ours: CacheContract, theirs: CacheContract, equal_tp: bool) -> None:
    if ours.plan.prefix_granularity != theirs.plan.prefix_granularity:
        raise ContractMismatch(
            "prefix_granularity", ours.plan.prefix_granularity, theirs.plan.prefix_granularity
        )
    if ours.group_ids() != theirs.group_ids():
        raise ContractMismatch("group order", list(ours.group_ids()), list(theirs.group_ids()))
    for gid in ours.group_ids():
        a, b = ours.spec(gid), theirs.spec(gid)
        for attr in _SPEC_ATTRS:
            if getattr(a, attr) != getattr(b, attr):
                raise ContractMismatch(
                    f"group {gid} {attr}", _show(getattr(a, attr)), _show(getattr(b, attr))
                )
        _check_fields(ours, theirs, gid, equal_tp)


def _check_fields(ours: CacheContract, theirs: CacheContract, gid: str, equal_tp: bool) -> None:
    mine = [f.field_id for f in ours.fields_for_group(gid)]
    peer = [f.field_id for f in theirs.fields_for_group(gid)]
    if mine != peer:
        only_mine = sorted(set(mine) - set(peer))
        only_peer = sorted(set(peer) - set(mine))
        raise ContractMismatch(
            f"group {gid} field ids",
            f"{len(mine)} fields (only here: {only_mine[:4]})",
            f"{len(peer)} fields (only there: {only_peer[:4]})",
        )
    for fid in mine:
        a, b = ours.field(fid), theirs.field(fid)
        where = f"group {gid} field {fid}"
        if a.dtype != b.dtype:
            raise ContractMismatch(f"{where} dtype", a.dtype, b.dtype)
        pa, pb = ours.partition(fid), theirs.partition(fid)
        if pa != pb:
            raise ContractMismatch(
                f"{where} partition",
                "replicated" if pa is None else _show(pa),
                "replicated" if pb is None else _show(pb),
                hint=_page_order_hint(a.suffix, pa, pb),
            )
        if ours.global_shape(fid) != theirs.global_shape(fid):
            raise ContractMismatch(
                f"{where} global shape",
                _show(ours.global_shape(fid)),
                _show(theirs.global_shape(fid)),
            )
        if equal_tp and a.shape != b.shape:
            raise ContractMismatch(
                f"{where} local shape at equal TP", _show(a.shape), _show(b.shape)
            )
