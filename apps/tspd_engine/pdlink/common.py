"""What both PD links share: the replica mesh, the peer config, the transfer counters."""

from __future__ import annotations

from typing import Any

from tspd_core.layout import CacheContract, encode_contract
from tspd_core.pd import SOLO, GlooMesh, Mesh, PdTunables
from tspd_engine.pdlink.config import PdConfig
from tspd_engine.tp import TpGroup


def replica_mesh(tp: TpGroup) -> Mesh:
    """The agreement mesh of a replica: its TP group is the whole (gloo) world of its ranks,
    so the MIN all-reduce runs over the default group, like the model's collectives (and on
    the same thread, in the same order on every rank)."""
    if tp.size == 1:
        return SOLO
    import torch.distributed as dist

    return GlooMesh([dist.group.WORLD])


def peer_kwargs(contract: CacheContract, arena: Any, tp: TpGroup, cfg: PdConfig) -> dict[str, Any]:
    """The keyword arguments both peer configs take, for this rank of the replica."""
    return {
        "contract": encode_contract(contract).decode(),
        "arena": arena,
        "tp_size": tp.size,
        "tp_rank": tp.rank,
        "dp_size": cfg.dp_size,
        "dp_rank": cfg.dp_rank,
        "host": cfg.host,
        "protocol": cfg.protocol,
        "ib_device": cfg.ib_device,
        "tunables": cfg.tunables or PdTunables.from_env(),
        "debug": cfg.debug,
    }


def distinct_shards(contract: CacheContract) -> int:
    """How many ranks hold distinct slices of a page (KV heads split across TP; ranks that
    replicate a KV head hold the same bytes): a replica's page is this many rank pages."""
    for f in contract.plan.fields:
        part = contract.partition(f.field_id)
        if part is not None:
            return int(part.global_extent // f.shape[part.axis])
    return 1


def page_bytes(contract: CacheContract) -> int:
    """Payload bytes of one page on this rank, every field of every group."""
    return sum(f.payload_bytes for f in contract.plan.fields)


def canonical_layout(text: str) -> str:
    """The bootstrap server's layout canonicaliser for tspd peers: tspd_core's strict
    contract parser, so a P rank with a malformed contract is refused at registration."""
    from tspd_core.layout import canonical_contract

    return canonical_contract(text.encode()).decode()
