"""PD transfer peers: one rank's half of moving a request's KV from P to D.

Start a rank's peer with :meth:`PrefillPeer.start` or :meth:`DecodePeer.start`; each returns the
peer (scheduler thread: ``register``, ``poll``) and its outbox (forward thread). See docs/pd.md.
"""

from tspd_core.pd.config import DecodePeerConfig, PdTunables, PeerConfig, PrefillPeerConfig
from tspd_core.pd.decode.peer import DecodeOutbox, DecodePeer, RemotePrefillRow
from tspd_core.pd.errors import (
    ConfigError,
    FrameError,
    PdError,
    PeerError,
    TransferError,
    UsageError,
)
from tspd_core.pd.events import (
    BootstrapInfo,
    Bootstrapped,
    Failed,
    PdEvent,
    RemotePrefill,
    Succeeded,
)
from tspd_core.pd.layerwise.step_counter import StepCounter
from tspd_core.pd.metrics.registry import MetricsSnapshot
from tspd_core.pd.peer.agreement import SOLO, GlooMesh, Mesh, ReplicaGroup, SoloMesh
from tspd_core.pd.peer.transfer_peer import TransferPeer
from tspd_core.pd.prefill.peer import FirstToken, PrefillOutbox, PrefillPeer, RemoteDecodeRow
from tspd_core.pd.status import FailureCause, HandOver, TransferPoll
from tspd_core.pd.wire.frames import StatusMessage

__all__ = [
    "SOLO",
    "BootstrapInfo",
    "Bootstrapped",
    "ConfigError",
    "DecodeOutbox",
    "DecodePeer",
    "DecodePeerConfig",
    "Failed",
    "FailureCause",
    "FirstToken",
    "FrameError",
    "GlooMesh",
    "HandOver",
    "Mesh",
    "MetricsSnapshot",
    "PdError",
    "PdEvent",
    "PdTunables",
    "PeerConfig",
    "PeerError",
    "PrefillOutbox",
    "PrefillPeer",
    "PrefillPeerConfig",
    "RemoteDecodeRow",
    "RemotePrefill",
    "RemotePrefillRow",
    "ReplicaGroup",
    "SoloMesh",
    "StatusMessage",
    "StepCounter",
    "Succeeded",
    "TransferError",
    "TransferPeer",
    "TransferPoll",
    "UsageError",
]
