"""What SGLang's model gateway asks a worker besides its requests, answered by a node.

The gateway (``sglang-router``) registers a worker after ``GET /health`` answers 200 and reads
``GET /server_info`` and ``GET /model_info`` (falling back to ``/get_server_info`` and
``/get_model_info`` on a 404): the served model's name (``model_path``: the name requests
must give as ``model``), TP and DP sizes and the PD role (``disaggregation_mode``). Its load
policies read ``GET /get_load``; its health checks may use ``GET /health_generate``.

* ``/server_info``, ``/get_server_info`` → the node's settings in SGLang's names
  (``model_path``, ``served_model_name``, ``tp_size``, ``dp_size``, ``page_size``,
  ``context_length``, ``disaggregation_mode`` ``prefill``/``decode``/``null``,
  ``disaggregation_bootstrap_port`` on a prefill node, ``max_running_requests``, ...; and
  ``vocab_size``, tspd's own, so a router checks prompt ids before sending them);
* ``/model_info``, ``/get_model_info`` → ``model_path``, ``is_generation``, ``model_type``,
  ``architectures``;
* ``/get_load`` → one entry per replica: ``dp_rank``, ``num_reqs`` (running),
  ``num_waiting_reqs``, ``num_tokens`` (KV tokens in use), from the replicas' counters (503
  when they do not answer);
* ``/health_generate`` → 200 after a one-token generation of a one-token prompt went through
  a replica (not a PD half: no room), 503 with the reason otherwise (busy: ``Retry-After``);
* ``/flush_cache`` → 400: a node frees cached prefixes on demand and does not drop them on
  request; ``POST /abort_request`` ``{"rid"}`` → aborts the request of that id (SGLang's
  abort; ``{"success": true}`` whether or not the node knew it).
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from aiohttp import web

from tspd_engine.errors import EngineDeadError
from tspd_engine.frames import SamplingParams
from tspd_engine.node import runs
from tspd_engine.node.replicas import Node, NodeRole
from tspd_serving.http import HttpLimits, read_json
from tspd_serving.openai.errors import ApiError

#: How long ``/health_generate``'s one token may take (a queue of long prompts may be ahead).
HEALTH_GENERATE_TIMEOUT_S = 30.0
_DISAGGREGATION = {NodeRole.PREFILL: "prefill", NodeRole.DECODE: "decode"}


def add_routes(app: web.Application, node: Node, limits: HttpLimits) -> None:
    """Serve the routes above on ``app`` for ``node``."""
    info = _Info(node, limits)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, info.server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, info.model_info)
    app.router.add_get("/get_load", info.get_load)
    app.router.add_get("/health_generate", info.health_generate)
    app.router.add_route("*", "/flush_cache", info.flush_cache)
    app.router.add_post("/abort_request", info.abort_request)


class _Info:
    def __init__(self, node: Node, limits: HttpLimits) -> None:
        self.node, self.limits = node, limits

    async def server_info(self, request: web.Request) -> web.Response:
        info = self.node.info
        body: dict[str, object] = {
            "model_path": info.model,
            "served_model_name": info.model,
            "tokenizer_path": info.model,
            "tp_size": info.tp,
            "dp_size": info.dp,
            "page_size": info.page_size,
            "context_length": info.max_model_len,
            "vocab_size": info.vocab_size,  # not SGLang's: lets a router check ids first
            "max_running_requests": info.max_queued_requests,
            "disaggregation_mode": _DISAGGREGATION.get(info.role, "null"),
            "load_balance_method": "follow_bootstrap_room",  # a P picks replica room % dp
            "version": "tspd",
        }
        if info.role is NodeRole.PREFILL and info.bootstrap:
            body["disaggregation_bootstrap_port"] = int(info.bootstrap.rpartition(":")[2])
        return web.json_response(body)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.node.info.model,
            "tokenizer_path": self.node.info.model,
            "is_generation": True,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
        })  # fmt: skip

    async def get_load(self, request: web.Request) -> web.Response:
        try:
            replicas = await asyncio.to_thread(self.node.stats)
        except (EngineDeadError, TimeoutError) as exc:
            return web.json_response({"error": str(exc)}, status=503)
        page = self.node.info.page_size
        return web.json_response([_load(i, values, page) for i, values in enumerate(replicas)])

    async def health_generate(self, request: web.Request) -> web.Response:
        node = self.node
        problem = node.health()
        if problem:
            return web.json_response({"status": "unhealthy", "error": problem}, status=503)
        try:
            stream = runs.admit(node, [0], SamplingParams(max_tokens=1, ignore_eos=True), None,
                                None)  # fmt: skip
            async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
                async with aclosing(runs.outputs(node, stream)) as outs:
                    async for _ in outs:
                        pass
        except ApiError as exc:
            return runs.response(exc)
        except TimeoutError:
            why = f"no token within {HEALTH_GENERATE_TIMEOUT_S:g} s"
            return web.json_response({"status": "unhealthy", "error": why}, status=503)
        return web.json_response({"status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        message = ("this node does not flush its prefix cache on request: cached prefixes are "
                   "freed as new requests need their pages")  # fmt: skip
        return web.json_response({"success": False, "message": message}, status=400)

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_json(request, self.limits)
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str) or not rid:
            return web.json_response({"error": "'rid' must be a non-empty string"}, status=400)
        self.node.abort(rid)
        return web.json_response({"success": True})


def _load(replica: int, values: dict[str, float], page: int) -> dict[str, int]:
    """One replica's load in SGLang's ``/get_load`` names."""
    # reclaimable: free pages plus cached prefix pages an allocation may evict
    used = max(0.0, values.get("initial_free_pages", 0) - values.get("reclaimable_pages", 0))
    return {
        "dp_rank": replica,
        "num_reqs": int(values.get("running", 0)),
        "num_waiting_reqs": int(values.get("waiting", 0)),
        "num_tokens": int(used) * page,
    }
