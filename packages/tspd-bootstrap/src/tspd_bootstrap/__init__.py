"""tspd bootstrap server: the HTTP rendezvous through which decode ranks find prefill ranks.

Public API::

    BootstrapServer(host, port, *, embedding=False, layout_canonicalizer=...)  # start()/close()
    BootstrapClient(base_url, *, timeout=5.0, retries=3, backoff=0.1)          # peers' client
    Registry(kind)                                                             # pure registry
    canonical_layout(text) -> str                                              # default check

Errors derive from :class:`BootstrapError`. See docs/bootstrap.md.
"""

__version__ = "0.1.0"

from tspd_bootstrap.client import BootstrapClient
from tspd_bootstrap.errors import (
    BindError,
    BootstrapConflict,
    BootstrapError,
    BootstrapNotFound,
    BootstrapProtocolError,
    BootstrapRejected,
    BootstrapRequestError,
    BootstrapUnavailable,
    RegistrationError,
    ShutdownError,
)
from tspd_bootstrap.layout import LayoutCanonicalizer, canonical_layout
from tspd_bootstrap.model import (
    DeploymentView,
    ParallelInfo,
    RankAddress,
    RankEntry,
    Registration,
    Role,
    ServerKind,
)
from tspd_bootstrap.registry import Outcome, Registry
from tspd_bootstrap.server import BootstrapServer

__all__ = [
    "BindError",
    "BootstrapClient",
    "BootstrapConflict",
    "BootstrapError",
    "BootstrapNotFound",
    "BootstrapProtocolError",
    "BootstrapRejected",
    "BootstrapRequestError",
    "BootstrapServer",
    "BootstrapUnavailable",
    "DeploymentView",
    "LayoutCanonicalizer",
    "Outcome",
    "ParallelInfo",
    "RankAddress",
    "RankEntry",
    "Registration",
    "RegistrationError",
    "Registry",
    "Role",
    "ServerKind",
    "ShutdownError",
    "__version__",
    "canonical_layout",
]
