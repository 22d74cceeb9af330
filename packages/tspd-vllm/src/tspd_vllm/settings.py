"""The connector's settings: vLLM's ``kv_transfer_config`` (its role) and the
``kv_connector_extra_config`` object, checked once when the connector is built."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from tspd_vllm.errors import SettingsError

#: The keys ``kv_connector_extra_config`` may hold (anything else is a typo: refused).
KEYS = frozenset(
    {
        "bootstrap_host",
        "bootstrap_port",
        "serve_bootstrap",
        "host",
        "idle_wait_ms",
        "layerwise_interval",
    }
)


class Role(StrEnum):
    """Which half of PD a vLLM instance serves (``kv_role``)."""

    PREFILL = "kv_producer"
    DECODE = "kv_consumer"


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """One instance's connector settings.

    P: ``bootstrap_host``/``bootstrap_port`` is the tspd bootstrap server its ranks register
    with and D looks them up at (P's answer names it); with ``serve_bootstrap`` (the default)
    P's TP rank 0 serves it, embedded, bound to that address. ``host`` is the address this
    instance's transfer ranks advertise (default: ``$TSPD_HOST``, else the route's source
    address). ``idle_wait_ms``: how long a step that ran no forward waits on the transfer
    worker for news (vLLM steps without pause while a transfer is pending).
    ``layerwise_interval`` (P; 0, the default, is off): stream a prompt's KV through
    ``save_kv_layer`` while its later prefill chunks run, this many layers per write
    (:mod:`tspd_vllm.layerwise`).
    """

    role: Role
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 0
    serve_bootstrap: bool = True
    host: str | None = None
    idle_wait_ms: float = 5.0
    layerwise_interval: int = 0

    @property
    def bootstrap_url(self) -> str:
        return f"{self.bootstrap_host}:{self.bootstrap_port}"

    @classmethod
    def from_config(cls, kv_role: str | None, extra: Mapping[str, object] | None) -> Settings:
        """Parse vLLM's role and extra config (raises :class:`SettingsError`)."""
        try:
            role = Role(kv_role or "")
        except ValueError:
            raise SettingsError(
                f"TspdConnector serves kv_role kv_producer (P) or kv_consumer (D), got {kv_role!r}"
            ) from None
        extra = dict(extra or {})
        unknown = sorted(set(extra) - KEYS)
        if unknown:
            raise SettingsError(f"kv_connector_extra_config: unknown keys {unknown}")
        host = extra.get("bootstrap_host", "127.0.0.1")
        port = extra.get("bootstrap_port", 0)
        serve = extra.get("serve_bootstrap", True)
        advertised = extra.get("host", os.environ.get("TSPD_HOST"))
        idle = extra.get("idle_wait_ms", 5.0)
        interval = extra.get("layerwise_interval", 0)
        if not isinstance(host, str) or not host:
            raise SettingsError(f"bootstrap_host must be a host name, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise SettingsError(f"bootstrap_port must be a port number, got {port!r}")
        if role == Role.PREFILL and port == 0:
            raise SettingsError("a prefill instance needs bootstrap_port (D looks P up there)")
        if not isinstance(serve, bool):
            raise SettingsError(f"serve_bootstrap must be true or false, got {serve!r}")
        if advertised is not None and (not isinstance(advertised, str) or not advertised):
            raise SettingsError(f"host must be an address, got {advertised!r}")
        if isinstance(idle, bool) or not isinstance(idle, int | float) or not 0 <= idle <= 1000:
            raise SettingsError(f"idle_wait_ms must be within 0..1000, got {idle!r}")
        if isinstance(interval, bool) or not isinstance(interval, int) or not 0 <= interval <= 4096:
            raise SettingsError(f"layerwise_interval must be within 0..4096, got {interval!r}")
        if interval and role != Role.PREFILL:
            raise SettingsError("layerwise_interval is a prefill instance's setting (P sends)")
        return cls(
            role=role,
            bootstrap_host=host,
            bootstrap_port=port,
            serve_bootstrap=serve,
            host=advertised,
            idle_wait_ms=float(idle),
            layerwise_interval=interval,
        )
