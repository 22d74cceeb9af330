"""The prefill receiver's bookkeeping for one staged request and its items (scheduler thread).

Kept apart from :mod:`tspd_core.epd.receiver` so the admission rule reads as wire.md §1 states it
and can be tested without sockets: a request is DONE when every item landed, FAILED when it was
aborted, an item failed, or it stayed PENDING longer than the waiting timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tspd_core.epd.items import Admission, EmbeddingItem
from tspd_core.epd.pool import Extent
from tspd_core.ids import RequestId, Room


@dataclass(slots=True)
class RItem:
    """One item on this rank: its rows here, its extent, and what the encode rank said."""

    spec: EmbeddingItem
    row_start: int
    n_rows: int
    nbytes: int  #: rows (and deepstack rows) this rank receives
    extent: Extent | None = None  #: None while waiting for pool space
    handed: bool = False  #: its address went to the sink (the encode rank may write)
    settled: bool = False  #: the sink's final note arrived: no write can come any more
    landed: bool = False
    failed: str | None = None


@dataclass(slots=True)
class RRequest:
    """One staged request, in the same order on every rank of the replica."""

    rid: RequestId
    items: list[RItem]
    pd_room: Room | None
    staged_at: float
    aborted: str | None = None
    timed_out: float | None = None  #: the timeout it exceeded, once it did
    _by_room: dict[Room, RItem] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        rid: RequestId,
        items: Sequence[EmbeddingItem],
        pd_room: Room | None,
        now: float,
        geometry: Callable[[int], tuple[int, int]],
        bytes_per_row: int,
    ) -> RRequest:
        """Each item's rows on this rank (``geometry(span) -> (row_start, n_rows)``)."""
        built = []
        for spec in items:
            start, n = geometry(spec.n_tokens)
            built.append(RItem(spec, start, n, n * bytes_per_row))
        request = cls(rid, built, pd_room, now)
        request._by_room = {item.spec.room: item for item in built}
        return request

    def item(self, room: Room) -> RItem:
        return self._by_room[room]

    def any_failed(self) -> bool:
        return any(item.failed is not None for item in self.items)

    def reason(self, code: Admission) -> str:
        """Why the request failed, as this rank saw it (``code`` is its local code)."""
        if code is not Admission.FAILED:
            return "failed on another rank of the prefill replica"
        if self.aborted is not None:
            return self.aborted
        for item in self.items:
            if item.failed is not None:
                return f"item of room {item.spec.room}: {item.failed}"
        return f"timed out: embeddings did not all arrive within {self.timed_out:g} s"


def local_code(request: RRequest, now: float, timeout_s: float) -> Admission:
    """This rank's admission code for ``request`` (wire.md §1, before the replica's MIN)."""
    if request.aborted is not None or request.any_failed():
        return Admission.FAILED
    if all(item.landed for item in request.items):
        return Admission.DONE
    if now - request.staged_at > timeout_s:
        request.timed_out = timeout_s
        return Admission.FAILED
    return Admission.PENDING
