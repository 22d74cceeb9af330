"""The router's configuration (frozen; validated eagerly)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from urllib.parse import urlsplit

from tspd_serving.http import HttpLimits
from tspd_serving.tokenizer import ContentSpecials

#: The shortest default health check timeout: a node's event loop on a loaded machine may
#: take a few hundred milliseconds to answer, which must not take it out.
MIN_CHECK_TIMEOUT_S = 1.0


class NodeApi(StrEnum):
    """The HTTP API the nodes speak (:mod:`tspd_router.sglang`)."""

    TSPD = "tspd"  #: tspd's own: /generate with a nested ``pd`` object, NDJSON streams, /info
    #: SGLang's: TokenSpeed's ``GenerateReqInput`` with top-level ``bootstrap_*``, SSE streams,
    #: /server_info (TokenSpeed's and SGLang's nodes; tspd's speak it too)
    SGLANG = "sglang"


class Policy(StrEnum):
    """How a node of a role is picked among the healthy ones."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"  # fewest requests in flight through this router (ties: in turn)


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    """Nodes, policy and limits of one router.

    PD mode: ``prefill`` and ``decode`` node URLs (each request goes to one of each).
    Colocated mode: ``colocated`` node URLs. A router serves one mode.
    """

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()
    policy: Policy = Policy.ROUND_ROBIN
    #: The API every node of this router speaks (one per cluster).
    node_api: NodeApi = NodeApi.TSPD
    #: The name ``/v1/models`` lists and requests must name (None: the nodes' model name).
    model: str | None = None
    health_interval_s: float = 1.0
    #: Consecutive failed health checks before a node is taken out (and its requests that
    #: still wait for a first token fail).
    health_failures: int = 2
    #: How long one health check may take before it counts as failed (None: the interval,
    #: at least :data:`MIN_CHECK_TIMEOUT_S`, so a stopped node is out within about
    #: ``health_failures`` intervals; a node answers ``/health`` without waiting for its
    #: engine, so a busy node is not slow to answer).
    health_timeout_s: float | None = None
    request_timeout_s: float = 600.0
    #: ``max_tokens`` of a chat completion that names none (OpenAI's is the context).
    chat_max_tokens: int = 256
    #: Accept ``temperature``/``top_p`` asking for sampling and decode greedily anyway
    #: (default: refuse them with a 400, since the engine only decodes greedily).
    accept_sampling: bool = False
    #: PD: pass P's first token on as soon as P answers (it sampled it at the end of its
    #: forward), not with D's first piece after the KV moved; TTFT then leaves the transfer
    #: out. A stream whose transfer then fails has begun (200): it ends with an SSE error
    #: event. False holds a stream until D's first token, so such a failure is a real status.
    early_first_token: bool = True
    nodes_timeout_s: float = 5.0  #: connect timeout towards the nodes
    #: How special-token text in chat message content is encoded: as those special tokens
    #: (Hugging Face's default: a user can forge turns) or as plain text.
    chat_content_special_tokens: ContentSpecials = ContentSpecials.PARSE
    #: Threads that parse, render and tokenize requests off the event loop (at most this
    #: many at once; more wait their turn).
    tokenizer_threads: int = 2
    #: Header, idle and body time limits and the body size and depth the router accepts.
    http: HttpLimits = field(default_factory=HttpLimits)

    def __post_init__(self) -> None:
        for url in (*self.prefill, *self.decode, *self.colocated):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"node URL {url!r} must look like http://host:port")
        pd = bool(self.prefill or self.decode)
        if pd and self.colocated:
            raise ValueError("a router serves PD nodes or colocated nodes, not both")
        if pd and not (self.prefill and self.decode):
            raise ValueError("PD mode needs at least one prefill node and one decode node")
        if not pd and not self.colocated:
            raise ValueError("give nodes: --prefill and --decode (PD) or --colocated")
        if self.health_interval_s <= 0 or self.health_failures < 1:
            raise ValueError("health interval must be > 0 s and failures >= 1")
        if self.health_timeout_s is not None and self.health_timeout_s <= 0:
            raise ValueError("the health check timeout must be > 0 s")
        if self.chat_max_tokens < 1 or self.request_timeout_s <= 0:
            raise ValueError("chat max tokens must be >= 1 and the request timeout > 0")
        if self.tokenizer_threads < 1:
            raise ValueError("the router needs at least 1 tokenizer thread")

    @property
    def pd(self) -> bool:
        return bool(self.prefill)

    @property
    def check_timeout_s(self) -> float:
        """How long one health check may take."""
        return self.health_timeout_s or max(self.health_interval_s, MIN_CHECK_TIMEOUT_S)
