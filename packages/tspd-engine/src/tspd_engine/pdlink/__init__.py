"""PD wiring of the reference engine: a replica's ranks as prefill or decode transfer peers.

``attach(core, cfg)`` starts the rank's peer (its transfer worker process) and registers the
matching link as the core's :class:`~tspd_engine.loop.hooks.PdHooks`; see docs/engine.md.
"""

from tspd_core.pd import TransferPeer
from tspd_engine.loop.core import EngineCore
from tspd_engine.loop.hooks import PdHooks
from tspd_engine.pdlink.config import PdConfig, PdRole
from tspd_engine.pdlink.contract import canonical_layout
from tspd_engine.pdlink.decode import DecodeLink
from tspd_engine.pdlink.prefill import PrefillLink


def attach(core: EngineCore, cfg: PdConfig) -> PdHooks:
    """Start this rank's PD peer for ``cfg.role`` and join it to ``core``'s loop.

    Raises :class:`tspd_core.pd.PdError` when the peer cannot start (e.g. a prefill rank
    cannot reach its bootstrap server); the caller stops the rank.
    """
    link: PdHooks
    if cfg.role is PdRole.PREFILL:
        link = PrefillLink.start(core, cfg)
    else:
        link = DecodeLink.start(core, cfg)
    core.add_hooks(link)
    return link


def peer_of(core: EngineCore) -> TransferPeer | None:
    """The transfer peer ``attach`` joined to ``core`` (``None`` without PD)."""
    links = [h for h in core.hooks if isinstance(h, PrefillLink | DecodeLink)]
    return links[0].peer if links else None


__all__ = [
    "DecodeLink",
    "PdConfig",
    "PdRole",
    "PrefillLink",
    "attach",
    "canonical_layout",
    "peer_of",
]
