"""Chained page keys: determinism, chaining, prefix sharing, trace-derived keys."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from tspd_core.sched import InvalidInput, as_keys, page_keys, page_keys_from_block_hashes


def test_keys_are_stable_across_processes() -> None:
    here = page_keys(np.arange(40), 16).tolist()
    code = (
        "import numpy as np; from tspd_core.sched import page_keys;"
        "print(page_keys(np.arange(40), 16).tolist())"
    )
    there = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert there.strip() == str(here)
    assert len(here) == 2  # the trailing 8 tokens form no full page


def test_key_depends_on_the_whole_prefix_not_only_the_page() -> None:
    a = page_keys([1, 2, 3, 4, 5, 6], 2)
    b = page_keys([9, 2, 3, 4, 5, 6], 2)  # differs in page 0 only
    c = page_keys([1, 2, 3, 4, 7, 7], 2)  # differs in page 2 only
    assert a[0] != b[0]
    assert a[1] != b[1]
    assert a[2] != b[2]
    assert a[:2].tolist() == c[:2].tolist()
    assert a[2] != c[2]


def test_chain_extends_from_a_parent_key() -> None:
    tokens = np.arange(100, 164)
    whole = page_keys(tokens, 8)
    head = page_keys(tokens[:24], 8)
    tail = page_keys(tokens[24:], 8, parent=int(head[-1]))
    assert np.concatenate([head, tail]).tolist() == whole.tolist()


def test_keys_match_a_direct_blake2b_of_the_first_page() -> None:
    from hashlib import blake2b

    expected = blake2b(bytes(8) + np.array([5, 6], "<i4").tobytes(), digest_size=8).digest()
    assert int(page_keys([5, 6, 7], 2)[0]) == int.from_bytes(expected, "little")


def test_block_hash_keys_name_pages_by_block_and_end_token() -> None:
    # 4-token blocks, 2-token pages: pages 0,1 lie in block 0; pages 2,3 in block 1.
    keys = page_keys_from_block_hashes([7, 8, 9], 4, 2, 10)
    assert len(keys) == 5  # 10 tokens -> 5 full pages, all inside the 3 blocks
    same_first_block = page_keys_from_block_hashes([7, 5], 4, 2, 8)
    assert keys[:2].tolist() == same_first_block[:2].tolist()
    assert keys[2] != same_first_block[2]
    assert len(set(keys.tolist())) == 5
    # Pages straddling blocks take the block holding their last token (page 1 of 3-token pages).
    straddle = page_keys_from_block_hashes([7, 8], 4, 3, 8)
    assert len(straddle) == 2
    assert straddle[1] != page_keys_from_block_hashes([7, 6], 4, 3, 8)[1]
    assert straddle[0] == page_keys_from_block_hashes([7, 6], 4, 3, 8)[0]
    # Pages past the last block get no key.
    assert len(page_keys_from_block_hashes([7], 4, 2, 100)) == 2


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: page_keys([1, 2], 0), "page_size must be a positive int, got 0"),
        (lambda: page_keys([-1, 2], 1), "token ids must lie in 0 .. 2**31-1"),
        (lambda: page_keys([2**31], 1), "token ids must lie in 0 .. 2**31-1"),
        (lambda: page_keys([[1]], 1), "tokens must be a 1-D integer array, got shape (1, 1)"),
        (lambda: page_keys([1], 1, parent=-1), "parent key must be an unsigned 64-bit int, got -1"),
        (lambda: page_keys_from_block_hashes([1], 0, 1, 1), "block_tokens must be >= 1, got 0"),
        (lambda: page_keys_from_block_hashes([1], 1, 1, -1), "num_tokens must be >= 0, got -1"),
        (
            lambda: page_keys_from_block_hashes([1.5], 1, 1, 1),
            "hash_ids must be a 1-D integer array, got shape (1,)",
        ),
        (lambda: as_keys([-1]), "page keys must be unsigned 64-bit integers: Python integer -1"),
        (lambda: as_keys(np.array([-3])), "page keys must be unsigned 64-bit integers, got int64"),
        (
            lambda: as_keys(np.zeros((2, 2), dtype=np.uint64)),
            "page keys must be a 1-D array, got shape (2, 2)",
        ),
    ],
)
def test_bad_arguments_raise_invalid_input(call: object, message: str) -> None:
    with pytest.raises(InvalidInput, match=re.escape(message)):
        call()  # type: ignore[operator]


def test_as_keys_accepts_full_uint64_range() -> None:
    assert as_keys([1, 2**64 - 1]).tolist() == [1, 2**64 - 1]
    assert as_keys(np.array([3], dtype=np.uint32)).dtype == np.uint64
