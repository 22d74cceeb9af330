"""Whole items from row shards: what a prefill replica runs after a request is admitted.

In row-shard mode each rank of the replica received only its block of every item's rows
(wire.md §2.5), so the encode node's bytes cross the network once, not once per rank. Before the
forward needs whole items, the replica rebuilds them: every rank broadcasts its own block to the
others over the replica's process group (gloo on CPU, NCCL on GPU), as raw bytes so any dtype
works. In identity mode every rank has every row already and this is a copy.

Collective in row-shard mode: every rank calls :func:`assemble` for the same admitted request in
the same round, as it does :meth:`EmbeddingReceiver.settle`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tspd_core.epd.items import LandedItem, LandedRequest, ShardMode, shard_rows


def assemble(
    request: LandedRequest, tp_size: int, group: dist.ProcessGroup | None = None
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """``(rows, deepstack rows or None)`` of every item, whole, in new tensors.

    The results do not alias the receive pool, so the request may be released right after.
    ``group`` is the replica's process group (None: the default group, whose rank p must be
    the replica's rank p).
    """
    return [_item(item, tp_size, group) for item in request.items]


def _item(
    item: LandedItem, tp_size: int, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if item.mode is ShardMode.IDENTITY:
        deep = None if item.deepstack is None else item.deepstack.clone()
        return item.embedding.clone(), deep
    main = _whole(item.embedding, item, tp_size, group)
    deep = None if item.deepstack is None else _whole(item.deepstack, item, tp_size, group)
    return main, deep


def _whole(
    shard: torch.Tensor, item: LandedItem, tp_size: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    full = torch.empty((item.span, shard.shape[1]), dtype=shard.dtype, device=shard.device)
    full[item.row_start : item.row_start + item.n_rows] = shard
    raw = full.view(torch.uint8)  # broadcast bytes: gloo has no bfloat16 reduction type issues
    for p in range(tp_size):
        start, n = shard_rows(item.span, p, tp_size)
        if n:
            src = p if group is None else dist.get_global_rank(group, p)
            dist.broadcast(raw[start : start + n], src=src, group=group)
    return full
