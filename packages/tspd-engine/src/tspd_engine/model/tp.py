"""Tensor parallelism: how heads split across ranks, and the process-group calls the model uses.

Sharding (Megatron style): q/k/v and gate/up are split by output rows (column parallel),
o/down by input columns (row parallel) followed by an all-reduce. Query heads split evenly.
KV heads split evenly while TP ≤ KV heads; beyond that each KV head is replicated on
``tp // kv_heads`` consecutive ranks, which is what the layout planner's replica groups expect
(only one representative of a replica group sends KV in PD).

Threading: a :class:`TpGroup` is used by the rank's engine thread only; collectives are issued in
the same order on every rank of the group (the engine loop guarantees that).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, re-exported

from tspd_engine.model.config import ModelConfig
from tspd_serving.errors import ConfigError

#: The environment variable gloo reads for the interface its pairs listen on, and the one a
#: replica's ranks use (they all run on one host).
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
LOOPBACK_IFNAME = "lo"


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """One rank's slice of every sharded dimension of a :class:`ModelConfig`."""

    rank: int
    size: int
    q_heads: int
    q_head_start: int
    kv_heads: int
    kv_head_start: int
    intermediate: int
    intermediate_start: int
    #: How many ranks hold each of this rank's KV heads (1 unless TP exceeds the KV heads).
    kv_replicas: int

    @classmethod
    def build(cls, cfg: ModelConfig, rank: int, size: int) -> ShardPlan:
        """Raises :class:`ConfigError` when ``cfg`` cannot be split ``size`` ways (naming the
        TP sizes that can)."""
        if size <= 0 or not 0 <= rank < size:
            raise ConfigError(f"rank {rank} outside TP size {size}")
        why = split_refusal(cfg, size)
        if why:
            sizes = ", ".join(map(str, valid_tp_sizes(cfg)))
            raise ConfigError(f"TP {size} cannot split the model: {why}; valid TP sizes: {sizes}")
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        if size <= kv:
            kv_local, kv_start, replicas = kv // size, rank * (kv // size), 1
        else:
            kv_local, kv_start, replicas = 1, rank // (size // kv), size // kv
        q_local = heads // size
        inter = cfg.intermediate_size // size
        return cls(
            rank, size, q_local, rank * q_local, kv_local, kv_start, inter, rank * inter, replicas
        )


def split_refusal(cfg: ModelConfig, size: int) -> str:
    """Why ``cfg`` cannot be split over ``size`` ranks ("" if it can)."""
    heads, kv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if heads % size:
        return f"num_attention_heads {heads} is not divisible by TP size {size}"
    if inter % size:
        return f"intermediate_size {inter} is not divisible by TP size {size}"
    if size <= kv and kv % size:
        return f"num_key_value_heads {kv} is not divisible by TP size {size}"
    if size > kv and size % kv:
        return f"TP size {size} is not a multiple of num_key_value_heads {kv}"
    return ""


def valid_tp_sizes(cfg: ModelConfig) -> list[int]:
    """Every TP size the model splits over (at most one query head per rank)."""
    return [n for n in range(1, cfg.num_attention_heads + 1) if not split_refusal(cfg, n)]


class TpGroup:
    """The collectives of one attention-TP group; a no-op group at TP 1.

    Owned by the rank's engine thread. ``all_reduce`` sums in place; gloo's ring algorithm
    gives every rank the same bits, so every rank's argmax agrees.
    """

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self.rank = rank
        self.size = size

    @classmethod
    def init_gloo(cls, rank: int, size: int, store_addr: str, timeout_s: float) -> TpGroup:
        """Join the gloo group whose rendezvous is the ``TCPStore`` at ``store_addr``
        (``host:port``; the launcher serves it, so no rank has to pick a port for it)."""
        host, _, port = store_addr.rpartition(":")
        store = TCPStore(host, int(port), size, False, _td(timeout_s))
        # Gloo listens for its pairs on the address the host name resolves to (often the
        # host's LAN address) unless told an interface: a replica's ranks share this host, so
        # loopback it is. An operator's own GLOO_SOCKET_IFNAME still wins.
        os.environ.setdefault(GLOO_IFNAME_ENV, LOOPBACK_IFNAME)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=size, timeout=_td(timeout_s)
        )
        return cls(rank, size)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(tensor)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size > 1:
            dist.broadcast(tensor, src)
        return tensor

    def all_reduce_min(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return tensor

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def destroy(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
