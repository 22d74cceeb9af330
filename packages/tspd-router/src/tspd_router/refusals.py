"""A node's answers other than success, as the router's errors.

A node at capacity refuses a request before its engine sees it: 503, ``Retry-After`` and
``{"error", "busy": true}`` (its admission control). That one is :class:`NodeBusy`, which the
dispatcher answers by trying another node of the role, and only when none is left passes on
as a 429 (:func:`overloaded`). Every other answer is the request's failure or refusal
(:func:`node_error`): a 400 the client's, anything else the node's (502), a failed transfer
``transfer_failed``.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from tspd_router.errors import ApiError, BadRequest, Overloaded, UpstreamFailed
from tspd_router.nodes import NodeState

#: The longest Retry-After passed on to a client, whatever a node asks for.
MAX_RETRY_AFTER_S = 60


class NodeBusy(Overloaded):
    """A node refused one attempt for being at capacity (503 with ``"busy": true``, the
    node's admission control): the dispatcher tries another node of its role, and only
    when none is left does the client get a 429 (:func:`overloaded`)."""

    def __init__(self, node: NodeState, message: str, retry_after: int) -> None:
        super().__init__(f"{node.role} node {node.url} is busy: {message}", retry_after)
        self.node = node


def refusal(
    side: str, node: NodeState, resp: aiohttp.ClientResponse, body: dict[str, Any]
) -> ApiError:
    """The error of a node's answer other than 200: busy (:class:`NodeBusy`) or not."""
    if resp.status == 503 and body.get("busy") is True:
        message = str(body.get("error") or "at capacity")[:300]
        return NodeBusy(node, message, retry_after(resp.headers.get("Retry-After")))
    return node_error(side, node, resp.status, body)


def retry_after(value: str | None) -> int:
    """A node's ``Retry-After`` in whole seconds (at least 1; 1 when missing or not a
    number of seconds; at most :data:`MAX_RETRY_AFTER_S`, whatever a node claims)."""
    seconds = int(value) if value is not None and value.strip().isdigit() else 1
    return min(max(seconds, 1), MAX_RETRY_AFTER_S)


def overloaded(refusals: list[NodeBusy]) -> Overloaded:
    """The client's 429 once every node that could take the request refused it as busy."""
    why = "; ".join(busy.message for busy in refusals)
    return Overloaded(f"every node that could serve the request is busy ({why})"[:1000],
                      max(busy.retry_after for busy in refusals))  # fmt: skip


def node_error(side: str, node: NodeState, status: int, body: Any) -> ApiError:
    """The router's error for a node's refusal or failure (its body says which)."""
    body = body if isinstance(body, dict) else {}
    error = str(body.get("error") or f"HTTP {status}")[:500]
    finish = body.get("finish_reason")
    if finish == "transfer":
        return UpstreamFailed(error, "transfer_failed")
    if status in (400, 413) or finish == "error":
        return BadRequest(f"the {side} node refused the request: {error}", cause="refused")
    if finish == "abort":
        return UpstreamFailed(f"the request was aborted on {side} node {node.url}", "aborted")
    return UpstreamFailed(f"{side} node {node.url} failed: {error}", f"{side}_failed")
