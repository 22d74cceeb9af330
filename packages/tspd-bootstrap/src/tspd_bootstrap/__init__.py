"""tspd bootstrap server: the HTTP rendezvous through which decode ranks find prefill ranks.

Public API::

    BootstrapServer(host, port, *, embedding=False, layout_canonicalizer=None) # start()/close()
    BootstrapClient(base_url, *, timeout=5.0, retries=3, backoff=0.1)          # peers' client
    ClusterCredential.resolve(token, token_file)  # the optional cluster credential (HMAC seals)
    client.health(timeout=HEALTH_TIMEOUT)        # one probe; (2 s connect, 3 s read), wire.md §3
    Registry(kind)                                                             # pure registry
    default_canonicalizer() -> (str) -> str   # tspd_core's strict contract form, by name

Errors derive from :class:`BootstrapError`. See docs/bootstrap.md.
"""

from tspd_bootstrap.auth import (
    AUTH_EXTENSION,
    ClusterCredential,
    CredentialConfigError,
    CredentialError,
)
from tspd_bootstrap.client import HEALTH_TIMEOUT, BootstrapClient, Timeout
from tspd_bootstrap.errors import (
    BindError,
    BootstrapConflict,
    BootstrapError,
    BootstrapNotFound,
    BootstrapProtocolError,
    BootstrapRejected,
    BootstrapRequestError,
    BootstrapUnauthorized,
    BootstrapUnavailable,
    RegistrationError,
    ShutdownError,
)
from tspd_bootstrap.layout import (
    DEFAULT_CANONICALIZER,
    LayoutCanonicalizer,
    default_canonicalizer,
    load_canonicalizer,
)
from tspd_bootstrap.model import (
    LEASE_EXTENSION,
    DeploymentView,
    ParallelInfo,
    RankAddress,
    RankEntry,
    Registration,
    Role,
    ServerKind,
)
from tspd_bootstrap.registry import DEFAULT_LEASE_S, Outcome, Registry
from tspd_bootstrap.server import BootstrapServer
from tspd_bootstrap.version import __version__

__all__ = [
    "AUTH_EXTENSION",
    "DEFAULT_CANONICALIZER",
    "DEFAULT_LEASE_S",
    "HEALTH_TIMEOUT",
    "LEASE_EXTENSION",
    "BindError",
    "BootstrapClient",
    "BootstrapConflict",
    "BootstrapError",
    "BootstrapNotFound",
    "BootstrapProtocolError",
    "BootstrapRejected",
    "BootstrapRequestError",
    "BootstrapServer",
    "BootstrapUnauthorized",
    "BootstrapUnavailable",
    "ClusterCredential",
    "CredentialConfigError",
    "CredentialError",
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
    "Timeout",
    "__version__",
    "default_canonicalizer",
    "load_canonicalizer",
]
