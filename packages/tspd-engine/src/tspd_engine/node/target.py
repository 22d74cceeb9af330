"""The PD target of a request in SGLang's shape: top-level ``bootstrap_host``,
``bootstrap_port`` and ``bootstrap_room``, as SGLang's model gateway (``sglang-router``) and
TokenSpeed's ``GenerateReqInput`` carry them, on ``/generate`` and the OpenAI routes alike.

The gateway sends the same body to P and D with ``bootstrap_host`` set to the host of the
prefill URL it was given, ``bootstrap_port`` to the port given beside that URL (null when none
was) and a random 63-bit ``bootstrap_room``. A node resolves that into the
:class:`~tspd_engine.frames.PdTarget` its own ``pd`` object would name:

* a **prefill node** knows its own bootstrap server, so a null port means its port and a null
  host its host; and the name the caller reached this node by (the request's ``Host``) names
  this node, so ``bootstrap_host`` equal to that name, with the node's own port, is the
  node's own server (the gateway's ``--prefill http://p0.internal:8100 8998`` works whatever
  address the node advertises). A prefill node contacts nobody on the request's word (its
  ranks register with their own server), so the rule only decides which requests are meant
  for it; any other address is refused as before (:mod:`tspd_engine.node.allow`);
* a **decode node** does contact the address: it needs a host, a null port is
  :data:`DEFAULT_BOOTSTRAP_PORT` (TokenSpeed's and SGLang's default), and the node's allowlist
  decides as for its own ``pd`` object.

A body without ``bootstrap_room`` (or with it null) is not a PD request: it is generated where
it lands. Lists (SGLang's batches) are refused: one room is one prompt.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from tspd_core.ids import MAX_ROOM
from tspd_engine.frames import PdTarget
from tspd_engine.node.replicas import NodeInfo, NodeRole
from tspd_serving.errors import RequestError

#: The bootstrap port a decode node assumes when a request names none (wire.md §3:
#: ``--disaggregation-bootstrap-port``'s default in TokenSpeed and SGLang).
DEFAULT_BOOTSTRAP_PORT = 8998
#: The keys that make a body SGLang's: a gateway adds the ``bootstrap_*`` ones to every PD
#: request, and ``sampling_params`` is how SGLang's ``/generate`` takes its limits.
KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def reached_host(host_header: str | None) -> str | None:
    """The host name a caller reached this node by, from its ``Host`` header (None when it
    sent none or one that does not parse)."""
    if not host_header:
        return None
    try:
        return urlsplit(f"//{host_header}").hostname
    except ValueError:
        return None


def top_level_target(body: dict[str, Any], info: NodeInfo, reached: str | None) -> PdTarget | None:
    """The PD target the body's top-level ``bootstrap_*`` fields name on this node (see the
    module docstring), or None without a room; :class:`RequestError` saying what is wrong."""
    room, host, port = (body.get(key) for key in ("bootstrap_room", "bootstrap_host",
                                                  "bootstrap_port"))  # fmt: skip
    if room is None:
        return None
    if type(room) is not int or not 0 <= room <= MAX_ROOM:
        raise RequestError(
            f"'bootstrap_room' must be an integer in 0..2**63-1 (one prompt per room), "
            f"got {_shown(room)}"
        )
    if host is not None and (not isinstance(host, str) or not host):
        raise RequestError(f"'bootstrap_host' must be a host name, got {_shown(host)}")
    if port is not None and (type(port) is not int or not 1 <= port <= 65535):
        raise RequestError(f"'bootstrap_port' must be an integer in 1..65535, got {_shown(port)}")
    if info.role is NodeRole.PREFILL and info.bootstrap:
        own_host, _, own_text = info.bootstrap.rpartition(":")
        own_port = int(own_text)
        port = own_port if port is None else port
        if host is None or (host == reached and port == own_port):
            host = own_host
    elif host is None:
        raise RequestError(
            "'bootstrap_host' is required with 'bootstrap_room': the prefill node's host "
            "(its bootstrap server's)"
        )
    return PdTarget(room, host, DEFAULT_BOOTSTRAP_PORT if port is None else port)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
