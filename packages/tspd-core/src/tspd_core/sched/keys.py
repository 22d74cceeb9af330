"""Chained per-page prefix keys.

A prompt's reusable prefix is identified page by page: the key of full page ``i`` depends on
the key of page ``i - 1`` and the tokens of page ``i``, so two prompts share key ``i`` exactly
when they share all tokens up to the end of page ``i`` (the same shape as the Mooncake traces'
``hash_ids``, one per 512-token block). Keys are unsigned 64-bit integers.

Two sources, one key space per store (do not mix them in one :class:`PrefixKvStore`):

* :func:`page_keys` hashes token ids (the engine): BLAKE2b with an 8-byte digest, stable across
  processes and machines (Python's salted ``hash()`` is not).
* :func:`page_keys_from_block_hashes` derives page keys from a trace's per-block chained hash
  ids (the simulator), fully vectorised.
"""

from __future__ import annotations

from hashlib import blake2b

import numpy as np
from numpy.typing import ArrayLike, NDArray

from tspd_core.sched.errors import InvalidInput

KeyArray = NDArray[np.uint64]

_U64 = (1 << 64) - 1
_U64_DTYPE = np.dtype(np.uint64)
_TOKEN_MAX = np.iinfo(np.int32).max


def page_keys(tokens: ArrayLike, page_size: int, *, parent: int = 0) -> KeyArray:
    """Keys of every *full* page of ``tokens`` (a trailing partial page gets no key).

    ``key_i = BLAKE2b-64(key_{i-1} as 8 little-endian bytes || page i's tokens as int32 LE)``
    with ``key_{-1} = parent``: 0 for a prompt, or the last key of an earlier chain to extend
    it (keys of ``a + b`` equal keys of ``a`` followed by ``page_keys(b, parent=keys_a[-1])``
    when ``len(a)`` is a multiple of ``page_size``).
    """
    _check_page_size(page_size)
    if not 0 <= parent <= _U64:
        raise InvalidInput(f"parent key must be an unsigned 64-bit int, got {parent}")
    ids = np.asarray(tokens)
    if ids.ndim != 1 or (len(ids) and ids.dtype.kind not in "iu"):
        raise InvalidInput(f"tokens must be a 1-D integer array, got shape {ids.shape}")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) > _TOKEN_MAX):
        raise InvalidInput("token ids must lie in 0 .. 2**31-1")
    count = len(ids) // page_size
    data = memoryview(ids[: count * page_size].astype("<i4").tobytes())
    step = page_size * 4
    prev = parent.to_bytes(8, "little")
    digests = []
    for i in range(count):
        h = blake2b(prev, digest_size=8)
        h.update(data[i * step : (i + 1) * step])
        prev = h.digest()
        digests.append(prev)
    return np.frombuffer(b"".join(digests), dtype="<u8").astype(np.uint64)


def page_keys_from_block_hashes(
    hash_ids: ArrayLike, block_tokens: int, page_size: int, num_tokens: int
) -> KeyArray:
    """Page keys from per-block chained hash ids (Mooncake trace ``hash_ids``).

    Block ``b`` covers tokens ``[b * block_tokens, (b + 1) * block_tokens)`` and its hash id
    names everything up to its end. Full page ``i`` ends at token ``e = (i + 1) * page_size``;
    its key mixes the hash id of the block holding token ``e - 1`` with ``e``, which names the
    first ``e`` tokens exactly. Pages beyond ``num_tokens`` or beyond the last block get none.
    """
    _check_page_size(page_size)
    if block_tokens < 1:
        raise InvalidInput(f"block_tokens must be >= 1, got {block_tokens}")
    if num_tokens < 0:
        raise InvalidInput(f"num_tokens must be >= 0, got {num_tokens}")
    blocks = np.asarray(hash_ids)
    if blocks.ndim != 1 or (len(blocks) and blocks.dtype.kind not in "iu"):
        raise InvalidInput(f"hash_ids must be a 1-D integer array, got shape {blocks.shape}")
    covered = min(num_tokens, len(blocks) * block_tokens)
    ends = np.arange(1, covered // page_size + 1, dtype=np.uint64) * np.uint64(page_size)
    owners = (ends - np.uint64(1)) // np.uint64(block_tokens)
    mixed = blocks.astype(np.uint64)[owners.astype(np.intp)] * np.uint64(0x9E3779B97F4A7C15)
    return _splitmix64(mixed ^ ends)


def as_keys(keys: ArrayLike) -> KeyArray:
    """``keys`` as a 1-D uint64 array (no copy when it already is one)."""
    if isinstance(keys, np.ndarray):
        if keys.ndim != 1:
            raise InvalidInput(f"page keys must be a 1-D array, got shape {keys.shape}")
        if keys.dtype is _U64_DTYPE or keys.dtype == np.uint64:  # identity first: ~30 ns
            return keys
        if keys.size and (keys.dtype.kind not in "iu" or int(keys.min()) < 0):
            raise InvalidInput(f"page keys must be unsigned 64-bit integers, got {keys.dtype}")
        return keys.astype(np.uint64)
    try:
        items = list(keys)  # type: ignore[arg-type]
        if not all(isinstance(k, int | np.integer) for k in items):
            raise TypeError("not all integers")
        return np.array(items, dtype=np.uint64)
    except (OverflowError, TypeError) as exc:
        raise InvalidInput(f"page keys must be unsigned 64-bit integers: {exc}") from exc


def _splitmix64(x: KeyArray) -> KeyArray:
    # The SplitMix64 finaliser: a bijection on uint64 with full avalanche; wraps by design.
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _check_page_size(page_size: int) -> None:
    if not isinstance(page_size, int) or page_size < 1:
        raise InvalidInput(f"page_size must be a positive int, got {page_size!r}")
