"""What starting either role's peer shares: checking the config and building the worker spec."""

from __future__ import annotations

import logging

from tspd_core.layout import CacheContract, encode_contract, parse_contract
from tspd_core.pd.config import PeerConfig, WorkerRole
from tspd_core.pd.errors import ConfigError
from tspd_core.pd.layerwise.schedule import LayerwiseSpec
from tspd_core.pd.peer.worker_handle import WorkerHandle
from tspd_core.pd.proc.handle import Entry
from tspd_core.pd.worker.spec import WorkerSpec


def parse_config_contract(config: PeerConfig) -> CacheContract:
    """The config's contract, checked against its arena (size) — before any process starts."""
    try:
        contract = parse_contract(config.contract.encode())
    except ValueError as exc:
        raise ConfigError(f"the peer's cache contract is invalid: {exc}") from exc
    nbytes = config.arena.numel() * config.arena.element_size()
    if nbytes != contract.plan.arena_bytes:
        raise ConfigError(
            f"the arena has {nbytes} bytes but the contract describes "
            f"{contract.plan.arena_bytes}; allocate exactly contract.plan.arena_bytes"
        )
    return contract


def start_worker(
    role: WorkerRole,
    main: Entry,
    config: PeerConfig,
    contract: CacheContract,
    bootstrap_url: str | None = None,
    layerwise: LayerwiseSpec | None = None,
) -> WorkerHandle:
    """Start the rank's transfer worker at ``main`` (the role's entry point, e.g.
    :func:`tspd_core.pd.prefill.worker.main`) and wait until it serves."""
    pd_logger = logging.getLogger("tspd_core.pd")
    spec = WorkerSpec(
        role=role,
        contract=encode_contract(contract).decode(),
        host=config.advertised_host(),
        tp_size=config.tp_size,
        tp_rank=config.tp_rank,
        dp_size=config.dp_size,
        dp_rank=config.dp_rank,
        protocol=config.protocol,
        ib_device=config.ib_device,
        max_batch=config.max_batch(),
        write_window=config.write_window(),
        tunables=config.tunables,
        bootstrap_url=bootstrap_url,
        log_level=logging.DEBUG if config.debug else pd_logger.getEffectiveLevel(),
        mooncake_env=tuple(sorted(config.mooncake_env.items())),
        layerwise=layerwise,
        credential=config.credential,
    )
    return WorkerHandle.start(spec, config.arena, main, config.start_method, config.start_timeout_s)
