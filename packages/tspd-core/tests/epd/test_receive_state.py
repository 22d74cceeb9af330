"""The prefill receiver's admission rule (wire.md §1) per request, without sockets."""

from __future__ import annotations

from tspd_core.epd.items import Admission, EmbeddingItem, shard_rows
from tspd_core.epd.receive_state import RRequest, local_code
from tspd_core.ids import RequestId, Room


def _request(*spans: int, rank: int = 1, size: int = 3) -> RRequest:
    items = [EmbeddingItem(Room(100 + i), "h", 1, n) for i, n in enumerate(spans)]
    return RRequest.build(
        RequestId("r"), items, Room(5), 10.0, lambda span: shard_rows(span, rank, size), 6
    )


def test_geometry_and_bytes_per_item() -> None:
    r = _request(7, 2)
    assert [(i.row_start, i.n_rows, i.nbytes) for i in r.items] == [(3, 2, 12), (1, 1, 6)]
    assert r.item(Room(101)) is r.items[1]


def test_codes_follow_the_items() -> None:
    r = _request(7, 2)
    assert local_code(r, 11.0, 300.0) is Admission.PENDING
    r.items[0].landed = True
    assert local_code(r, 11.0, 300.0) is Admission.PENDING
    r.items[1].landed = True
    assert local_code(r, 11.0, 300.0) is Admission.DONE
    assert r.reason(Admission.DONE) == "failed on another rank of the prefill replica"


def test_failure_wins_and_says_why() -> None:
    r = _request(7, 2)
    r.items[0].landed = True
    r.items[1].failed = "encode rank 0 failed the item"
    assert local_code(r, 11.0, 300.0) is Admission.FAILED
    assert r.reason(Admission.FAILED) == "item of room 101: encode rank 0 failed the item"
    r.aborted = "client left"
    assert r.reason(Admission.FAILED) == "client left"


def test_pending_past_the_deadline_is_failed() -> None:
    r = _request(4)
    assert local_code(r, 310.0, 300.0) is Admission.PENDING  # exactly at the limit: still waits
    assert local_code(r, 310.5, 300.0) is Admission.FAILED
    assert r.reason(Admission.FAILED) == "timed out: embeddings did not all arrive within 300 s"
    r.items[0].landed = True  # landed late but before anyone acted: done beats the clock
    assert local_code(r, 400.0, 300.0) is Admission.DONE


def test_request_without_items_is_done() -> None:
    assert local_code(_request(), 0.0, 1.0) is Admission.DONE
