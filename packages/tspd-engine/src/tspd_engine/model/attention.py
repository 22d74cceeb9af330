"""Paged attention in torch over head-major (HND) KV pages.

A ragged batch packs every row's new tokens into one ``[T, ...]`` tensor. Each row ``b`` has
``context[b]`` tokens already in its pages and ``new[b]`` tokens in this step (prefill chunk,
or 1 for decode). The step writes the new K/V into the pages first, then every row attends
over its pages gathered by block table, with a causal mask by absolute position:

```
 page table of row b:  [ 7 | 3 | 9 ]          one layer's K pages (HND): [pages, heads, P, D]
 positions:             0..P-1, P..2P-1, ...  gather → [B, heads, pages*P, D], mask j > pos
```

Rows are padded to the longest row (block table padded with the null page 0), so one batched
matmul serves prefill and decode alike. Slots past a row's length are masked and zeroed: a
row never reads KV it did not write, whatever bytes the pages hold.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from tspd_core.feed import to_device

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class AttnMeta:
    """Where a ragged batch's tokens go and what each attends to (device tensors)."""

    positions: torch.Tensor  # [T] absolute position of each new token
    write_pages: torch.Tensor  # [T] page each new token's K/V is written to
    write_slots: torch.Tensor  # [T] slot inside that page
    tables: torch.Tensor  # [B, max_pages] block tables padded with the null page 0
    token_row: torch.Tensor  # [T] row of each packed token
    token_col: torch.Tensor  # [T] index of the token among its row's new tokens
    mask: torch.Tensor  # [B, 1, max_new, max_pages * P] True where a query may attend
    key_valid: torch.Tensor  # [B, 1, max_pages * P, 1] True for slots the row has written
    last_token: torch.Tensor  # [B] packed index of each row's last new token
    max_new: int


def pack_tables(tables: list[npt.NDArray[np.integer]]) -> tuple[IntArray, IntArray, IntArray]:
    """Concatenate per-row page tables into (tables, offsets, lengths), the round layout."""
    length = np.array([len(t) for t in tables], dtype=np.int64)
    offset = np.cumsum(length) - length
    flat = np.concatenate(tables).astype(np.int64) if tables else np.zeros(0, np.int64)
    return flat, offset, length


def pad_tables(
    tables: npt.NDArray[np.integer], offset: IntArray, length: IntArray, need: IntArray
) -> IntArray:
    """Rows of the concatenated ``tables`` (row b at ``offset[b]``, ``length[b]`` pages) cut to
    ``need[b]`` pages and padded with the null page 0 to one ``[B, max(need)]`` array."""
    short = np.flatnonzero(length < need)
    if len(short):
        b = int(short[0])
        raise ValueError(f"row {b}: block table has {int(length[b])} pages, {int(need[b])} needed")
    cols = np.arange(int(need.max()))
    idx = offset[:, None] + cols[None, :]
    valid = cols[None, :] < need[:, None]
    flat = np.asarray(tables, dtype=np.int64)
    return np.where(valid, flat[np.minimum(idx, max(len(flat) - 1, 0))], 0)


def build_meta(
    context: IntArray,
    new: IntArray,
    tables: npt.NDArray[np.integer],
    table_offset: IntArray,
    table_len: IntArray,
    page_size: int,
    device: torch.device,
) -> AttnMeta:
    """Vectorised metadata for rows with ``context`` cached and ``new`` fresh tokens.

    ``tables`` holds every row's page table back to back (row ``b`` at ``table_offset[b]``,
    ``table_len[b]`` pages, as the scheduler's decode rounds lay them out); each must cover
    positions ``0 .. context[b] + new[b] - 1``: the scheduler allocates before the step.
    """
    total = context + new
    padded = pad_tables(tables, table_offset, table_len, -(-total // page_size))
    token_row = np.repeat(np.arange(len(new)), new)
    starts = np.cumsum(new) - new
    token_col = np.arange(int(new.sum())) - np.repeat(starts, new)
    positions = context[token_row] + token_col
    max_new = int(new.max())
    query_pos = context[:, None] + np.arange(max_new)[None, :]
    key_pos = np.arange(padded.shape[1] * page_size)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]
    dev = functools.partial(to_device, device=device)
    return AttnMeta(
        positions=dev(positions),
        write_pages=dev(padded[token_row, positions // page_size]),
        write_slots=dev(positions % page_size),
        tables=dev(padded),
        token_row=dev(token_row),
        token_col=dev(token_col),
        mask=dev(mask[:, None]),
        key_valid=dev((key_pos[None, :] < total[:, None])[:, None, :, None]),
        last_token=dev(starts + new - 1),
        max_new=max_new,
    )


def write_kv(
    k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta
) -> None:
    """Store the new tokens' ``k``/``v`` ``[T, heads, D]`` into their page slots."""
    k_pages[meta.write_pages, :, meta.write_slots] = k
    v_pages[meta.write_pages, :, meta.write_slots] = v


def paged_attention(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, meta: AttnMeta
) -> torch.Tensor:
    """Causal attention of ``q`` ``[T, q_heads, D]`` over the rows' pages → ``[T, q_heads, D]``.

    ``k_pages``/``v_pages`` are one layer's ``[pages, kv_heads, P, D]`` views; query head ``h``
    reads KV head ``h // (q_heads // kv_heads)`` (GQA).
    """
    rows = meta.tables.shape[0]
    kv_heads, dim = k_pages.shape[1], k_pages.shape[3]
    keys = k_pages[meta.tables].permute(0, 2, 1, 3, 4).reshape(rows, kv_heads, -1, dim)
    values = v_pages[meta.tables].permute(0, 2, 1, 3, 4).reshape(rows, kv_heads, -1, dim)
    # Slots past a row's length hold whatever the page held before (another request's KV, or
    # bytes a failed transfer left). A masked score still multiplies its value by 0, and
    # 0 * NaN is NaN, so clear them rather than trust them.
    keys = keys.where(meta.key_valid, 0.0)
    values = values.where(meta.key_valid, 0.0)
    padded = q.new_zeros(rows, meta.max_new, q.shape[1], dim)
    padded[meta.token_row, meta.token_col] = q
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2), keys, values, attn_mask=meta.mask, enable_gqa=True
    )
    return out.transpose(1, 2)[meta.token_row, meta.token_col]
