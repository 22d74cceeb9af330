"""One request's life on a node for the routes that answer in SGLang's or OpenAI's shape:
admission, its outputs, its end, and the node's refusals and failures as
:class:`~tspd_serving.openai.errors.ApiError`\\ s (OpenAI's error body, with its status).

:func:`admit` submits; :func:`outputs` follows the request and, however the caller stops
reading (a stop string matched, the client went away, an error), aborts it on its engine
unless it finished, and forgets it on the node. A prefill node fails the room of a request it
refused (:meth:`Node.refused`), as its native ``/generate`` does. Event loop only.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from aiohttp import web

from tspd_engine.errors import EngineDeadError, NodeBusyError
from tspd_engine.frames import FinishReason, Output, PdTarget, SamplingParams
from tspd_engine.node.replicas import RETRY_AFTER_S, Node
from tspd_engine.rank.client import RequestStream
from tspd_serving.errors import RequestError
from tspd_serving.openai.errors import ApiError, BadRequest


class NodeFailed(ApiError):
    """The node could not serve the request: its engine is gone, the PD transfer failed, the
    request was aborted (503; ``cause`` says which)."""

    status = 503


class NodeBusy(NodeFailed):
    """The node holds all the requests it may (503 with ``Retry-After`` and ``"busy": true``,
    as its native refusal: a router tries another node)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "busy")

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)}

    def body(self) -> dict[str, object]:
        return super().body() | {"busy": True}


def refused(exc: RequestError | ApiError) -> ApiError:
    """A refusal of the request (a bad body, a room this node may not serve) as a 400."""
    if isinstance(exc, ApiError):
        return exc
    return BadRequest(str(exc), cause="refused")


def response(error: ApiError) -> web.Response:
    """The error's answer (a body too large or too slow also closes the connection: the rest
    of it is not worth reading)."""
    answer = web.json_response(error.body(), status=error.status, headers=error.headers())
    if error.status in (408, 413):
        answer.force_close()
    return answer


def check_room(node: Node, target: PdTarget | None, problem: ApiError) -> None:
    """A request naming ``target`` was refused before an engine saw it: fail its room on a
    prefill node (D took its half at the same time and may hold pages for it)."""
    if target is not None:
        node.refused(target, f"the prefill node refused the request: {problem.cause}"[:200])


def admit(
    node: Node, prompt: list[int], params: SamplingParams, rid: str | None, target: PdTarget | None
) -> RequestStream:
    """Submit one request (:class:`ApiError` when the node refuses it or cannot take it)."""
    try:
        return node.submit(prompt, params, rid, target)
    except NodeBusyError as exc:
        raise NodeBusy(str(exc)) from None
    except RequestError as exc:
        raise refused(exc) from None
    except EngineDeadError as exc:
        raise NodeFailed(str(exc), "engine_dead") from None


async def outputs(node: Node, stream: RequestStream) -> AsyncGenerator[Output, None]:
    """Each output of the request in order; the last is its final one. A final output that
    is a failure raises instead (:func:`failure`). Close the generator to stop early: the
    request is aborted on its engine unless it finished."""
    try:
        while stream.final is None:
            try:
                out = await stream.next_output_async()
            except EngineDeadError as exc:
                raise NodeFailed(str(exc), "engine_dead") from None
            if out.finished and (error := failure(out)) is not None:
                raise error
            yield out
    finally:
        if stream.final is None:
            node.abort(stream.rid)  # a stop string, a client gone, an error: free its pages
        node.release(stream.rid)


def failure(out: Output) -> ApiError | None:
    """The error a final output stands for, or None when it ended normally (EOS, length)."""
    message = out.error or f"the request ended with {out.finish.name.lower()}"
    if out.finish == FinishReason.ERROR:
        return BadRequest(message, cause="refused")
    if out.finish == FinishReason.TRANSFER:
        return NodeFailed(message, "transfer_failed")
    if out.finish == FinishReason.ABORT:
        return NodeFailed("the request was aborted on this node", "aborted")
    return None


def finish_name(out: Output) -> str | None:
    """The engine's reason on a final output (``eos``, ``length``), None before."""
    return out.finish.name.lower() if out.finished else None
