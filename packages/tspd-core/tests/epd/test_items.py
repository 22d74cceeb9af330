"""EPD values: shard geometry (wire.md §2.5), item and chunk validation, admission order."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tspd_core.epd.items import (
    Admission,
    EmbeddingChunk,
    EmbeddingItem,
    dtype_name,
    shard_rows,
)
from tspd_core.ids import Room
from tspd_core.pd.errors import UsageError


def test_shard_rows_matches_the_wire_formula() -> None:
    assert [shard_rows(10, r, 4) for r in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert [shard_rows(2, r, 4) for r in range(4)] == [(0, 1), (1, 1), (2, 0), (2, 0)]
    assert shard_rows(7, 0, 1) == (0, 7)
    with pytest.raises(UsageError, match=r"^rank 2 is outside 0\.\.1$"):
        shard_rows(7, 2, 2)


@given(span=st.integers(0, 5000), size=st.integers(1, 64))
def test_shards_tile_the_span_in_rank_order(span: int, size: int) -> None:
    cursor = 0
    for r in range(size):
        start, n = shard_rows(span, r, size)
        assert start == cursor
        assert n in (span // size, span // size + 1)
        cursor += n
    assert cursor == span


def test_admission_min_is_the_least_advanced() -> None:
    assert min(Admission.DONE, Admission.PENDING) is Admission.PENDING
    assert min(Admission.DONE, Admission.FAILED) is Admission.FAILED
    assert [int(a) for a in Admission] == [0, 1, 2]


def test_item_validation() -> None:
    assert EmbeddingItem(Room(3), "h", 8998, 5).bootstrap_address == "h:8998"
    with pytest.raises(UsageError, match="n_tokens 0"):
        EmbeddingItem(Room(3), "h", 8998, 0)
    with pytest.raises(UsageError, match="is not host:port"):
        EmbeddingItem(Room(3), "", 8998, 1)
    with pytest.raises(UsageError, match=r"outside 0\.\.2"):
        EmbeddingItem(Room(-1), "h", 1, 1)


def test_chunk_validation() -> None:
    e = torch.zeros(4, 8, dtype=torch.bfloat16)
    chunk = EmbeddingChunk(Room(1), e, torch.zeros(4, 16, dtype=torch.bfloat16))
    assert (chunk.n_tokens, chunk.hidden, chunk.nbytes, chunk.deepstack_nbytes) == (4, 8, 64, 128)
    with pytest.raises(UsageError, match=r"\[n_tokens, hidden\]"):
        EmbeddingChunk(Room(1), torch.zeros(8))
    with pytest.raises(UsageError, match="deepstack must be"):
        EmbeddingChunk(Room(1), e, torch.zeros(3, 16, dtype=torch.bfloat16))
    with pytest.raises(UsageError, match="deepstack must be"):
        EmbeddingChunk(Room(1), e, torch.zeros(4, 16, dtype=torch.float32))
    with pytest.raises(UsageError, match="not supported"):
        EmbeddingChunk(Room(1), torch.zeros(2, 2, dtype=torch.complex64))
    assert dtype_name(torch.float16) == "torch.float16"
