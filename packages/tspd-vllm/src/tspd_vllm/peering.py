"""Small helpers the worker side's peers share (:mod:`tspd_vllm.worker`,
:mod:`tspd_vllm.layerwise`)."""

from __future__ import annotations

import logging

from tspd_core.ids import RequestId, Room
from tspd_core.pd import BootstrapInfo, DecodePeer, PdError, PrefillPeer
from tspd_vllm.params import Rendezvous

log = logging.getLogger(__name__)


def abort(peer: PrefillPeer | DecodePeer, rid: RequestId, reason: str) -> None:
    """Abort a tracked request; a lost transfer worker fails it at the next poll anyway."""
    try:
        peer.abort(rid, reason)
    except PdError as exc:
        log.warning("request %s: abort (%s) not delivered: %s", rid, reason, exc)


def info(meet: Rendezvous) -> BootstrapInfo:
    """The peer's view of a rendezvous."""
    return BootstrapInfo(meet.host, meet.port, Room(meet.room))
