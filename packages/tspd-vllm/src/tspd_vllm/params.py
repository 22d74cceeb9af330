"""A request's ``kv_transfer_params``: what a client (the PD front) asks and what P answers.

vLLM passes the request body's ``kv_transfer_params`` object through unchecked, so everything
here is client input: parsed strictly, refused with a :class:`TransferParamsError` that says
which key is wrong, never half-used. The keys are those of the ``kv_transfer_params`` flow of
vLLM's own PD proxy, with tspd's rendezvous in SGLang's names:

* to P: ``{"do_remote_decode": true}``, optionally ``"bootstrap_room"`` (the front picks the
  room; else P draws one);
* to P, from the front only: ``{"abort_room": int}`` — a room P holds KV for that no D will
  pull (the client went away, D refused or never answered): P fails it at once and frees its
  blocks instead of holding them until its bootstrap timeout (TokenSpeed's wire has no D → P
  abort, so the front, which knows, tells P);
* P's answer, which the front passes to D unchanged: ``{"do_remote_prefill": true,
  "bootstrap_host": str, "bootstrap_port": int, "bootstrap_room": int, "kv_tokens": int}``
  — ``kv_tokens``, P's prompt length, lets D's prompt go on past P's (the front appends P's
  first token, :mod:`tspd_vllm.relay`): D loads that many tokens' KV and computes the rest.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from tspd_core.ids import MAX_ROOM
from tspd_vllm.errors import TransferParamsError

MAX_HOST_CHARS = 253
MAX_TOKENS = 1 << 31


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where D finds the request's P: P's bootstrap server and the request's room."""

    host: str
    port: int
    room: int
    #: How many prompt tokens' KV P holds (P's prompt length); None: the whole prompt D gets.
    tokens: int | None = None

    def as_params(self) -> dict[str, object]:
        """P's answer: the ``kv_transfer_params`` D gets."""
        params: dict[str, object] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "bootstrap_host": self.host,
            "bootstrap_port": self.port,
            "bootstrap_room": self.room,
        }
        if self.tokens is not None:
            params["kv_tokens"] = self.tokens
        return params


def _flag(params: Mapping[str, object], key: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise TransferParamsError(f"kv_transfer_params.{key} must be true or false, got {value!r}")
    return value


def _int(params: Mapping[str, object], key: str, lo: int, hi: int) -> int:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise TransferParamsError(
            f"kv_transfer_params.{key} must be an integer in {lo}..{hi}, got {value!r}"
        )
    return value


def _mapping(params: object) -> Mapping[str, object] | None:
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise TransferParamsError(f"kv_transfer_params must be an object, got {type(params)}")
    return params


def wants_remote_decode(params: object) -> bool:
    """P: the client asks that this request's KV go to a D (``do_remote_decode``)."""
    mapping = _mapping(params)
    return mapping is not None and _flag(mapping, "do_remote_decode")


def room_for(params: object) -> int:
    """P: the room the front chose (``bootstrap_room``), else a fresh random one."""
    mapping = _mapping(params)
    if mapping is not None and "bootstrap_room" in mapping:
        return _int(mapping, "bootstrap_room", 0, MAX_ROOM)
    return secrets.randbelow(MAX_ROOM + 1)


def room_to_abort(params: object) -> int | None:
    """P: the room the front gives up (``abort_room``), or None when the request names none."""
    mapping = _mapping(params)
    if mapping is None or "abort_room" not in mapping:
        return None
    return _int(mapping, "abort_room", 0, MAX_ROOM)


def remote_prefill(params: object) -> Rendezvous | None:
    """D: where this request's KV comes from, or None when it is not a remote prefill."""
    mapping = _mapping(params)
    if mapping is None or not _flag(mapping, "do_remote_prefill"):
        return None
    host = mapping.get("bootstrap_host")
    if not isinstance(host, str) or not 0 < len(host) <= MAX_HOST_CHARS or not host.isascii():
        raise TransferParamsError(
            f"kv_transfer_params.bootstrap_host must be a host name, got {host!r}"
        )
    if any(c.isspace() or c in "/?#@" for c in host):
        raise TransferParamsError(f"kv_transfer_params.bootstrap_host {host!r} is not a host")
    port = _int(mapping, "bootstrap_port", 1, 65535)
    room = _int(mapping, "bootstrap_room", 0, MAX_ROOM)
    tokens = _int(mapping, "kv_tokens", 1, MAX_TOKENS) if "kv_tokens" in mapping else None
    return Rendezvous(host, port, room, tokens)
