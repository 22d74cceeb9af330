"""Many byte ranges of an arena, zeroed, gathered or scattered in bulk.

Zeroing D's new pages, and gathering or scattering a staged transfer, each touch up to tens of
thousands of byte ranges. One torch op per range (or per field) pays a dispatch each time, and
torch's CPU index kernels move uint8 tensors element by element (~0.2 GB/s). Instead the arena
is viewed as rows of ``g`` bytes, ``g`` being the largest size dividing every start and length,
so the ranges become one vector of row indices::

    ranges (start, length): (0, 64) (192, 128)        g = 64
    arena as rows of 64 B:  [r0][r1][r2][r3][r4] ...  rows = [0, 3, 4]

On CUDA one ``index_*`` kernel then does the work. On CPU the fastest tool differs per
direction. Gathering (P's side, read again at once by the TCP send) uses torch's index_select
on 8-byte words (16 KiB rows ~6.7 GB/s here, numpy's take ~2 GB/s). Scattering (D's side, into
pages nobody reads before the request decodes) goes through :mod:`._rowcopy`, a C loop over
the rows that writes large scatters (``STREAM_BYTES`` and up) with streaming stores past the
cache: 8 MiB of 1 KiB rows onto scrambled cold pages in 0.64 ms, where numpy's ``void`` rows
took ~1.8 ms. A ``memmove`` per range costs ~0.5 µs of Python, so it only copies a handful of
ranges, or ranges the row size would cut into many rows each.

Regular ranges go faster still. Re-slicing P TP 2 -> D TP 1 with a contiguous block table
scatters each P rank's half-pages: equal lengths at a constant stride, field after field. Such
a stretch is one strided copy (one native call per stretch, the GIL released)::

    ranges: (0,16K) (32K,16K) (64K,16K) ... | (8M,16K) (8M+32K,16K) ...
            └── stretch 1: stride 32K ──────┘ └── stretch 2 ──────────┘

:func:`stretches` finds them; the CPU paths use them when stretches hold 8+ ranges on average
(a gather), and scatters only when they also hold 256 KiB or more on average (8 MiB of 1 KiB
rows onto cold pages, measured here: in stretches of 16 rows 1.10 ms by stretches against
0.64 ms by rows; of 256 rows 0.43 against 0.46 ms; one stretch of 8 MiB streams at ~20 GB/s,
numpy's strided ``copyto`` of it ~6.5 GB/s). Every function refuses a range outside the arena
before copying anything (the copies go by address).
All functions run on the caller's thread; CUDA work goes on the current stream.
"""

from __future__ import annotations

import ctypes

import numpy as np
import numpy.typing as npt
import torch

from tspd_core.pd.transfer._rowcopy import copy_rows, copy_strided

I64 = npt.NDArray[np.int64]

#: Up to this many ranges a plain memmove loop beats numpy's fancy indexing on CPU.
LOOP_RANGES = 32
#: ... and up to this many, when the row size would cut each range into this many rows or
#: more, or the ranges are this long on average (the loop's ~0.5 µs a range is then small
#: against the copy, and it stays on this thread: torch's index kernels start intra-op
#: threads that fight the transfer engine's for the cores).
LOOP_RANGES_FINE = 2048
LOOP_ROWS_PER_RANGE = 8
LOOP_MEAN_BYTES = 4096
#: A scatter of this many bytes or more writes with streaming stores (past the caches: see
#: :mod:`tspd_core.pd.transfer._rowcopy`); a smaller one stays in the cache (one page of a
#: short prompt is read again by D's next decode step).
STREAM_BYTES = 2 << 20
#: Strided copies pay off once a stretch holds this many ranges on average.
STRETCH_MIN = 8
#: A strided scatter pays off once a stretch also holds this many bytes on average.
SCATTER_STRETCH_BYTES = 256 << 10


def byte_rows(starts: npt.ArrayLike, lengths: npt.ArrayLike) -> tuple[int, I64]:
    """``(g, rows)``: row size and row indices covering the ranges, in range order."""
    s = np.asarray(starts, dtype=np.int64)
    n = np.asarray(lengths, dtype=np.int64)
    if s.size == 0:
        return 1, np.zeros(0, dtype=np.int64)
    g = int(np.gcd.reduce(np.concatenate([s, n])))
    count = n // g
    first = np.repeat(s // g, count)
    skip = np.repeat(np.cumsum(count) - count, count)
    return g, first + (np.arange(int(count.sum()), dtype=np.int64) - skip)


def _rows(arena: torch.Tensor, g: int) -> npt.NDArray[np.void]:
    raw = arena.numpy()
    out: npt.NDArray[np.void] = raw[: raw.size // g * g].view(np.dtype((np.void, g)))
    return out


def _streams(total: int) -> bool:
    return total >= STREAM_BYTES


def _check_ranges(arena: torch.Tensor, s: I64, n: I64) -> None:
    """Every path below copies by address: a range outside the arena is refused first."""
    if s.size and (int(s.min()) < 0 or int(n.min()) < 0 or int((s + n).max()) > arena.numel()):
        raise ValueError(f"byte ranges reach outside the {arena.numel()}-byte arena")


def _loop(s: I64, n: I64) -> bool:
    """Copy range by range with ``memmove`` (CPU): a few ranges, or not too many that are
    long or that the row size would cut into many rows each."""
    if s.size <= LOOP_RANGES:
        return True
    if s.size > LOOP_RANGES_FINE:
        return False
    total = int(n.sum())
    if total >= LOOP_MEAN_BYTES * s.size:
        return True
    g = max(1, int(np.gcd.reduce(np.concatenate([s, n]))))
    return total // g >= LOOP_ROWS_PER_RANGE * s.size


def _cuda_rows(arena: torch.Tensor, g: int) -> torch.Tensor:
    return arena.as_strided((arena.numel() // g, g), (g, 1), arena.storage_offset())


def zero_ranges(arena: torch.Tensor, starts: npt.ArrayLike, lengths: npt.ArrayLike) -> None:
    """Zero every ``[start, start + length)`` of the 1-D uint8 ``arena``."""
    s, n = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    _check_ranges(arena, s, n)
    if s.size == 0:
        return
    if not arena.is_cuda and _loop(s, n):
        base = arena.data_ptr()
        for start, length in zip(s.tolist(), n.tolist(), strict=True):
            ctypes.memset(base + start, 0, length)
        return
    g, rows = byte_rows(s, n)
    if arena.is_cuda:
        index = torch.from_numpy(rows).to(arena.device, non_blocking=True)
        _cuda_rows(arena, g).index_fill_(0, index, 0)
    else:
        _rows(arena, g)[rows] = np.zeros(1, dtype=np.dtype((np.void, g)))


def gather(
    arena: torch.Tensor, starts: npt.ArrayLike, lengths: npt.ArrayLike, out: torch.Tensor
) -> int:
    """Copy the ranges' bytes back to back into ``out`` (uint8, same device); returns bytes."""
    s, n = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    _check_ranges(arena, s, n)
    total = int(n.sum())
    if total > out.numel():
        raise ValueError(f"gather of {total} bytes does not fit a {out.numel()}-byte buffer")
    if not (arena.is_contiguous() and out.is_contiguous()):
        raise ValueError("gather needs a contiguous arena and buffer (copies by address)")
    if not arena.is_cuda and _strided(arena, s, n, out[:total], to_arena=False):
        return total
    if not arena.is_cuda and _loop(s, n):
        src, dst = arena.data_ptr(), out.data_ptr()
        offsets = (np.cumsum(n) - n).tolist()
        for start, length, at in zip(s.tolist(), n.tolist(), offsets, strict=True):
            ctypes.memmove(dst + at, src + start, length)
        return total
    g, rows = byte_rows(s, n)
    if arena.is_cuda:
        index = torch.from_numpy(rows).to(arena.device, non_blocking=True)
        torch.index_select(_cuda_rows(arena, g), 0, index, out=out[:total].view(-1, g))
    elif g % 8 == 0 and arena.data_ptr() % 8 == 0 and out.data_ptr() % 8 == 0:
        # torch's index_select on 8-byte words runs ~3x faster than numpy's take on rows.
        words = arena[: arena.numel() // g * g].view(torch.int64).view(-1, g // 8)
        target = out[:total].view(torch.int64).view(-1, g // 8)
        torch.index_select(words, 0, torch.from_numpy(rows), out=target)
    else:
        np.take(_rows(arena, g), rows, axis=0, out=_rows(out[:total], g))
    return total


def scatter(
    arena: torch.Tensor, starts: npt.ArrayLike, lengths: npt.ArrayLike, data: torch.Tensor
) -> None:
    """Write ``data`` (the ranges' bytes back to back) into the ranges of ``arena``."""
    s, n = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    _check_ranges(arena, s, n)
    total = int(n.sum())
    if total != data.numel():
        raise ValueError(f"scatter of {data.numel()} bytes into ranges of {total} bytes")
    if not (arena.is_contiguous() and data.is_contiguous()):
        raise ValueError("scatter needs a contiguous arena and contiguous data (copies by address)")
    if not arena.is_cuda and _strided(arena, s, n, data, to_arena=True):
        return
    if not arena.is_cuda and _loop(s, n):
        src, dst = data.data_ptr(), arena.data_ptr()
        offsets = (np.cumsum(n) - n).tolist()
        for start, length, at in zip(s.tolist(), n.tolist(), offsets, strict=True):
            ctypes.memmove(dst + start, src + at, length)
        return
    g, rows = byte_rows(s, n)
    if arena.is_cuda:
        index = torch.from_numpy(rows).to(arena.device, non_blocking=True)
        _cuda_rows(arena, g).index_copy_(0, index, data.view(-1, g))
    else:
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        copy_rows(
            arena.data_ptr(), rows.ctypes.data, data.data_ptr(), rows.size, g, _streams(total)
        )


def stretches(starts: I64, lengths: I64, limit: int | None = None) -> tuple[I64, I64, I64] | None:
    """``(first, count, stride)`` of each maximal stretch of ranges with one length and a
    constant step between starts, in order, found greedily (a stretch of one range has stride
    0). None when there would be more than ``limit`` stretches (checked before the slow part).
    """
    k = starts.size
    z = np.zeros(0, dtype=np.int64)
    if k == 0:
        return z, z, z
    step = np.diff(starts)
    # Range i opens a stretch when its length differs from i - 1's; with the same length it
    # joins i - 1's stretch when the step into it repeats the step into i - 1, or when i - 1
    # opened the stretch (any step). Only the last case depends on earlier decisions, so the
    # loop below visits just those ranges, in order.
    same = np.zeros(k, dtype=bool)
    same[1:] = lengths[1:] == lengths[:-1]
    turns = np.flatnonzero(same[2:] & (step[1:] != step[:-1])) + 2
    first = np.flatnonzero(~same)
    if limit is not None and first.size + turns.size // 2 > limit:
        return None  # at least every other turn opens a stretch
    if turns.size:
        opened = np.zeros(k, dtype=bool)
        opened[first] = True
        for i in turns.tolist():
            opened[i] = not opened[i - 1]
        first = np.flatnonzero(opened)
    count = np.diff(np.append(first, k))
    stride = np.where(count > 1, np.append(step, 0)[first], 0)
    return first, count, stride


def _strided(arena: torch.Tensor, s: I64, n: I64, flat: torch.Tensor, to_arena: bool) -> bool:
    """Copy between the ranges and ``flat`` stretch by stretch (CPU); False when the ranges
    are too irregular for it to pay off (the caller takes the row path)."""
    if s.size < STRETCH_MIN:
        return False
    total = int(n.sum())
    if to_arena and total < SCATTER_STRETCH_BYTES:  # not even one stretch would be long
        return False
    found = stretches(s, n, limit=s.size // STRETCH_MIN)
    # Rows of one view must not overlap (a write) and numpy's views want no negative steps.
    if found is None or ((found[1] > 1) & (found[2] < n[found[0]])).any():
        return False
    if to_arena and total < SCATTER_STRETCH_BYTES * found[0].size:
        return False
    base, buf = arena.data_ptr(), flat.data_ptr()
    stream = to_arena and _streams(total)
    at = 0
    for i, c, step in zip(*(a.tolist() for a in found), strict=True):
        length = int(n[i])
        if to_arena:
            copy_strided(base + int(s[i]), step, buf + at, length, c, length, stream)
        else:
            copy_strided(buf + at, length, base + int(s[i]), step, c, length, False)
        at += c * length
    return True


def split_runs(src: I64, dst: I64, lengths: I64, limit: int) -> tuple[I64, I64, I64]:
    """Cut runs longer than ``limit`` bytes into consecutive runs of at most ``limit``."""
    if not (lengths > limit).any():
        return src, dst, lengths
    parts = -(-lengths // limit)
    k = np.arange(int(parts.sum()), dtype=np.int64) - np.repeat(np.cumsum(parts) - parts, parts)
    off = k * limit
    size = np.minimum(np.repeat(lengths, parts) - off, limit)
    return np.repeat(src, parts) + off, np.repeat(dst, parts) + off, size
