"""tspd's PD router: an OpenAI-compatible HTTP API in front of prefill and decode nodes.

See docs/router.md. ``make_app(RouterConfig(...))`` builds the aiohttp application;
``tspd-router --prefill URL --decode URL`` (or the launcher's ``tspd-launch router``) runs it.
"""

from tspd_router.app import make_app
from tspd_router.config import Policy, RouterConfig
from tspd_router.errors import BadRequest, RouterError, Unavailable, UpstreamFailed

__all__ = [
    "BadRequest",
    "Policy",
    "RouterConfig",
    "RouterError",
    "Unavailable",
    "UpstreamFailed",
    "make_app",
]
