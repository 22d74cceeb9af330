"""The encode rank's checks before it writes (wire.md §2.5) and the descriptors it writes."""

from __future__ import annotations

import numpy as np
import pytest

from tspd_core.epd.encode_state import ChunkMeta, ERoom, check_fanout, plan_writes
from tspd_core.epd.wire import ItemInfo
from tspd_core.ids import Room

CHUNK = ChunkMeta(Room(9), 4096, 10, 8, "torch.float16", 160, 8192, 320)  # deepstack: 2 levels


def _info(session: str, start: int, n: int, **kw: object) -> ItemInfo:
    fields: dict[str, object] = {
        "room": Room(9),
        "endpoint": "h",
        "port": 1,
        "session_id": session,
        "dst_ptr": 1 << 20,
        "deepstack_ptr": 2 << 20,
        "n_tokens": n,
        "hidden": 8,
        "dtype": "torch.float16",
        "has_deepstack": True,
        "required_dst_info_num": 2,
        "row_start": start,
        "span": 10,
    }
    fields.update(kw)
    return ItemInfo(**fields)  # type: ignore[arg-type]


def test_identity_and_contiguous_shards_pass() -> None:
    assert check_fanout([_info("a:1", 0, 10), _info("b:1", 0, 10)], CHUNK) is None
    assert check_fanout([_info("b:1", 5, 5), _info("a:1", 0, 5)], CHUNK) is None
    # a block of a bigger replica's shards, and 0-row shards anywhere
    assert (
        check_fanout([_info("a:1", 6, 2), _info("b:1", 8, 2), _info("c:1", 10, 0)], CHUNK) is None
    )


@pytest.mark.parametrize(
    ("infos", "why"),
    [
        (
            [_info("a:1", 0, 10, hidden=16)],
            "expects [*, 16] torch.float16; the encoded item is [*, 8] torch.float16",
        ),
        (
            [_info("a:1", 0, 10, dtype="torch.bfloat16")],
            "expects [*, 8] torch.bfloat16; the encoded",
        ),
        ([_info("a:1", 0, 9, span=9)], "receiver a:1 expects 9 rows; the encoded item has 10"),
        ([_info("a:1", 8, 3)], "receiver a:1 asks rows [8, 11) of 10"),
        (
            [_info("a:1", 0, 10, has_deepstack=False, deepstack_ptr=0)],
            "has_deepstack=0 but the item has deepstack",
        ),
        (
            [_info("a:1", 0, 10), _info("b:1", 0, 10, required_dst_info_num=3)],
            "receivers disagree on the fan-out",
        ),
        (
            [_info("a:1", 0, 4), _info("b:1", 5, 5)],
            "row shards are not contiguous: [0, 4) then [5, ...)",
        ),
        (
            [_info("a:1", 0, 10), _info("b:1", 0, 5)],
            "row shards are not contiguous: [0, 5) then [0, ...)",
        ),
    ],
)
def test_mismatches_are_named(infos: list[ItemInfo], why: str) -> None:
    got = check_fanout(infos, CHUNK)
    assert got is not None
    assert why in got


def test_item_without_deepstack_refuses_a_deepstack_receiver() -> None:
    plain = ChunkMeta(Room(9), 0, 10, 8, "torch.float16", 160)
    assert check_fanout([_info("a:1", 0, 10)], plain) == (
        "receiver a:1 has_deepstack=1 but the item has no deepstack"
    )


def test_plan_writes_addresses_each_shard_and_its_deepstack() -> None:
    w = plan_writes(_info("a:1", 3, 4), CHUNK, base_ptr=1_000_000)
    assert w.session == "a:1"
    assert w.src.tolist() == [1_000_000 + 4096 + 3 * 16, 1_000_000 + 8192 + 3 * 32]
    assert w.dst.tolist() == [1 << 20, 2 << 20]
    assert w.lengths.tolist() == [4 * 16, 4 * 32]
    assert w.src.dtype == np.uint64
    assert w.nbytes == 192
    empty = plan_writes(_info("b:1", 10, 0), CHUNK, base_ptr=1_000_000)
    assert (len(empty.src), empty.nbytes) == (0, 0)


def test_room_completeness_counts_sessions() -> None:
    room = ERoom(Room(9), 0.0)
    assert (room.required, room.complete) == (None, False)
    room.infos["a:1"] = _info("a:1", 0, 5)
    assert (room.required, room.complete) == (2, False)
    room.infos["a:1"] = _info("a:1", 0, 5)  # the same session again: still one
    assert not room.complete
    room.infos["b:1"] = _info("b:1", 5, 5)
    assert room.complete
