"""The router's SGLang mode (``--node-api sglang``): nodes driven over SGLang's HTTP API, as
TokenSpeed's nodes and SGLang's are (and tspd's own, which speak it too).

What changes against tspd's own node API (:mod:`tspd_router.dispatch`):

* **requests**: ``POST /generate`` with TokenSpeed's ``GenerateReqInput`` fields only —
  ``input_ids``, ``sampling_params`` (``max_new_tokens``, ``min_new_tokens``,
  ``stop_token_ids``, ``ignore_eos``, ``temperature`` 0: greedy), ``stream`` and, for PD, the
  top-level ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``. No ``rid``
  (TokenSpeed assigns its own and refuses a caller's): a request is aborted by closing its
  connection, which SGLang's, TokenSpeed's and tspd's nodes all take as an abort; a room P
  refused is failed by P itself.
* **answers**: D's stream is SSE (``data: {"text", "output_ids", "meta_info"}``, then
  ``data: [DONE]``). Streamed ``output_ids`` are the new ids on TokenSpeed's and tspd's nodes
  and all ids so far on SGLang's default; ``meta_info.completion_tokens`` (the count so far)
  tells which, so both read right. ``finish_reason`` ``{"type": "length"}`` ends a request at
  its length, ``{"type": "stop"}`` at an EOS or stop id, ``{"type": "abort"}`` is a failure.
  P's plain answer carries its first token in ``output_ids``, as tspd's does. Errors are
  ``{"error": {"message", "code"}}`` (tspd's nodes add ``"busy": true`` when at capacity).
* **nodes**: healthy while ``GET /health`` answers 200 (SGLang's has an empty body); what they
  serve comes from ``GET /server_info`` (``/get_server_info`` before SGLang 0.5): the model
  (``served_model_name`` or ``model_path``), the role (``disaggregation_mode``), the context
  (``context_length``), and a prefill node's bootstrap port (``disaggregation_bootstrap_port``,
  else 8998, the default); its bootstrap host is the host of its URL, as SGLang's gateway
  assumes.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

#: A prefill node's bootstrap port when it reports none (TokenSpeed's and SGLang's default).
DEFAULT_BOOTSTRAP_PORT = 8998
_ROLES = {"prefill": "prefill", "decode": "decode", "null": "colocated", None: "colocated"}


def generate_body(body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """The SGLang body of one of the dispatcher's requests (its own shape: ``input_ids``,
    ``max_tokens``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``pd``)."""
    sampling: dict[str, Any] = {
        "max_new_tokens": body["max_tokens"],
        "min_new_tokens": body["min_tokens"],
        "ignore_eos": body["ignore_eos"],
        "temperature": 0.0,
    }
    if body["stop_token_ids"]:
        sampling["stop_token_ids"] = list(body["stop_token_ids"])
    out: dict[str, Any] = {"input_ids": body["input_ids"], "sampling_params": sampling,
                           "stream": stream}  # fmt: skip
    pd = body.get("pd")
    if pd is not None:
        out |= {"bootstrap_host": pd["bootstrap_host"], "bootstrap_port": pd["bootstrap_port"],
                "bootstrap_room": pd["room"]}  # fmt: skip
    return out


def native_error(body: dict[str, Any]) -> dict[str, Any]:
    """An SGLang error body in tspd's words (``error`` a string, ``finish_reason``
    ``transfer`` for a failed KV transfer, ``busy``), for :mod:`tspd_router.refusals`."""
    error = body.get("error")
    if not isinstance(error, dict):
        return body
    out: dict[str, Any] = {"error": str(error.get("message") or error)[:500]}
    if error.get("code") == "transfer_failed":
        out["finish_reason"] = "transfer"
    if body.get("busy") is True:
        out["busy"] = True
    return out


def event_data(raw: bytes) -> bytes | None:
    """The payload of one SSE line (``data: ...``), or None for any other line."""
    line = raw.strip()
    if not line.startswith(b"data:"):
        return None
    return line[len(b"data:") :].strip()


def read_event(event: Any, seen: int) -> tuple[tuple[int, ...], str | None, int]:
    """The new ids, the finish (``length``/``eos``; None while it goes on) and the cached
    tokens of one stream event after ``seen`` ids; ValueError/KeyError/TypeError when the
    event is malformed, :class:`Failed` for an error or an abort."""
    if not isinstance(event, dict):
        raise TypeError("an event is not a JSON object")
    if "error" in event:
        raise Failed(native_error(event))
    ids = [int(t) for t in event["output_ids"]]
    meta = event.get("meta_info") or {}
    done = meta.get("completion_tokens")
    new = ids if type(done) is not int else ids[len(ids) - max(0, done - seen) :]
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind == "abort":
        message = finish.get("message") if isinstance(finish, dict) else None
        raise Failed({"error": str(message or "the request was aborted"), "finish_reason": "abort"})
    if kind not in (None, "length", "stop"):
        raise ValueError(f"unknown finish_reason {finish!r}")
    cached = int(meta.get("cached_tokens") or 0)
    return tuple(new), {"stop": "eos", None: None}.get(kind, kind), cached


class Failed(Exception):
    """A stream's error or abort event; ``body`` in tspd's words (:func:`native_error`)."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(str(body.get("error")))
        self.body = body


def node_info(server_info: Any, url: str) -> dict[str, Any]:
    """An SGLang ``/server_info`` as the router's node info (``role``, ``model``,
    ``bootstrap``, ``max_model_len``, ``vocab_size``); RuntimeError when it is not one."""
    if not isinstance(server_info, dict):
        raise RuntimeError("the node's /server_info is not a JSON object")
    mode = server_info.get("disaggregation_mode")
    role = _ROLES.get(mode) if isinstance(mode, str | None) else None
    if role is None:
        raise RuntimeError(f"the node reports disaggregation_mode {mode!r}")
    model = server_info.get("served_model_name") or server_info.get("model_path")
    info: dict[str, Any] = {"role": role, "model": model if isinstance(model, str) else None}
    for key, ours in (("context_length", "max_model_len"), ("vocab_size", "vocab_size")):
        if type(server_info.get(key)) is int:
            info[ours] = server_info[key]
    port = server_info.get("disaggregation_bootstrap_port")
    port = port if type(port) is int and 0 < port < 65536 else DEFAULT_BOOTSTRAP_PORT
    host = urlsplit(url).hostname or ""
    info["bootstrap"] = f"{host}:{port}"
    return info
