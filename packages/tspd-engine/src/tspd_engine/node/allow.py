"""Which bootstrap servers a node's PD half may contact on a request's word.

A ``/generate`` body names a bootstrap address (``pd.bootstrap_host``/``bootstrap_port``), and
the node's transfer peer then opens an HTTP look-up and ZMQ and Mooncake connections towards
whatever that server answers. Whoever can reach the endpoint could point a node anywhere
(another host's services, the node's own loopback ones), so a node contacts only:

* a **prefill node**: its own bootstrap server (the one it hosts or was given with
  ``--bootstrap``), under any name it reports or binds;
* a **decode node**: the entries of ``--allow-bootstrap`` (``HOST:PORT``, ``HOST:*`` for any
  port of a host, or ``*`` for anything); without the flag, any port of the node's own hosts
  (``--host`` and ``--advertise-host``, loopback when either is), which is every address a
  one-machine cluster (``tspd-launch local``) uses;

and refuses any other with a 400 naming the address and what would allow it (a decode node's
``--allow-bootstrap``; a prefill node has no such flag: it names its own server).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

ANY = "*"
#: What a refusal tells the caller to do, by default (a decode node's flag).
ALLOW_FLAG = "see --allow-bootstrap"
#: A prefill node's: it has no flag, whoever sent the request picked the wrong server.
OWN_ONLY = "a prefill node contacts only its own bootstrap server"
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def parse_entry(text: str) -> tuple[str, str]:
    """``HOST:PORT`` / ``HOST:*`` / ``*`` as (host, port or ``*``); ValueError if malformed."""
    if text == ANY:
        return ANY, ANY
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    valid_port = port == ANY or (port.isdigit() and 1 <= int(port) <= 65535)
    if not sep or not host or not valid_port:
        raise ValueError(f"a bootstrap allowlist entry is HOST:PORT, HOST:* or *, got {text!r}")
    return host, port


@dataclass(frozen=True, slots=True)
class BootstrapAllowlist:
    """The (host, port) pairs a node may contact; ``*`` is a wildcard in either place."""

    entries: frozenset[tuple[str, str]]
    #: The last words of a refusal: what would allow another server.
    remedy: str = ALLOW_FLAG

    @classmethod
    def of(cls, texts: Iterable[str], remedy: str = ALLOW_FLAG) -> BootstrapAllowlist:
        return cls(frozenset(parse_entry(t) for t in texts), remedy)

    @classmethod
    def own_hosts(cls, *hosts: str | None) -> BootstrapAllowlist:
        """Any port of ``hosts`` (wildcards skipped), plus loopback when one of them is."""
        named = {h for h in hosts if h is not None and h not in _WILDCARDS}
        if named & _LOOPBACK:
            named |= _LOOPBACK
        return cls(frozenset((h, ANY) for h in named))

    def allows(self, host: str, port: int) -> bool:
        wanted = str(port)
        return any(h in (ANY, host) and p in (ANY, wanted) for h, p in self.entries)

    def describe(self) -> str:
        if not self.entries:
            return "none"
        return ", ".join(sorted(ANY if h == ANY else f"{h}:{p}" for h, p in self.entries))

    def refusal(self, host: str, port: int) -> str:
        """Why ``host:port`` may not be contacted, or ``""``."""
        if self.allows(host, port):
            return ""
        return (
            f"bootstrap server {host}:{port} is not one this node may contact "
            f"(allowed: {self.describe()}; {self.remedy})"
        )
