"""Every byte of the bootstrap HTTP protocol (wire.md §3), encoded and decoded in one place.

Server side: :func:`decode_json`, :func:`parse_registration` and :func:`parse_route_query` turn
untrusted input into model values or raise :class:`RegistrationError` (status 400/413 and a stable
reason code). Client side: the ``*_from_json`` functions check a server's answer and raise
``ValueError`` on a shape they cannot use.

Unknown keys in a ``PUT /route`` body are ignored: newer TokenSpeed peers add keys (``pp_size``,
``pp_layer_partition``, ...) and a rendezvous that rejected them would break mixed deployments.

One key is tspd's own: ``tspd_extensions``, the list of tspd-only protocol extensions a rank
speaks (``["tspd.stage/2"]``). It is optional in the ``PUT`` and appears in that rank's look-up
answer only when non-empty, so a TokenSpeed peer sees exactly TokenSpeed's bodies, and a
TokenSpeed server (which drops it) makes tspd peers fall back to the common protocol.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tspd_bootstrap.errors import RegistrationError
from tspd_bootstrap.model import (
    DeploymentView,
    ParallelInfo,
    RankAddress,
    RankEntry,
    Registration,
    Role,
    ServerKind,
)

MAX_LAYOUT_BYTES = 262_144  # wire.md §4: a canonical contract is at most this long
MAX_BODY_BYTES = (1 << 20) + MAX_LAYOUT_BYTES  # room for an escaped layout plus the other keys
MAX_WORLD_SIZE = 65_536  # TP <= 1024 (wire.md §2.1) times a generous DP
MAX_PORT = 65_535
PARALLEL_INFO = -1  # engine_rank = target_dp_group = -1 asks for the parallel info

_INT_PARAM = re.compile(r"-?[0-9]{1,12}")
EXTENSIONS_KEY = "tspd_extensions"
MAX_EXTENSIONS = 16
_EXTENSION = re.compile(r"[a-z0-9][a-z0-9._/-]{0,63}")
# Hostnames, IPv4, IPv6 (with an optional %zone): what a ZMQ tcp:// endpoint can carry.
_HOST = re.compile(r"[A-Za-z0-9._:%\-\[\]]{1,255}")
_REQUIRED = ("role", "world_size", "dp_size", "rank_ip", "rank_port", "engine_rank")
_ROLES = {ServerKind.KV: (Role.PREFILL,), ServerKind.EMBEDDING: (Role.PREFILL, Role.ENCODE)}


def bad(code: str, message: str, status: int = 400) -> RegistrationError:
    return RegistrationError(status, code, message)


def decode_json(raw: bytes) -> object:
    """Parse a request body: UTF-8, strict JSON (no NaN/Infinity), bounded nesting."""
    if len(raw) > MAX_BODY_BYTES:
        raise bad("too_large", f"body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}", 413)
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise bad("bad_json", f"body is not UTF-8: {exc.reason} at byte {exc.start}") from exc
    except RecursionError as exc:  # "[[[[...": json recurses per nesting level
        raise bad("bad_json", "body nests too deeply to be a registration") from exc
    except ValueError as exc:  # JSONDecodeError, huge-int digit limit, NaN
        raise bad("bad_json", f"body is not valid JSON: {exc}") from exc


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def parse_registration(body: object, kind: ServerKind) -> Registration:
    """Validate a ``PUT /route`` body; the KV layout is returned as sent (not canonical yet)."""
    if not isinstance(body, dict):
        raise bad("bad_type", f"body must be a JSON object, got {json_type(body)}")
    missing = [key for key in _REQUIRED if key not in body]
    if kind is ServerKind.KV and "cache_layout" not in body:
        missing.append("cache_layout")
    if missing:
        raise bad("missing_field", f"missing field(s): {', '.join(missing)}")
    world_size = _int_field(body, "world_size", 1, MAX_WORLD_SIZE)
    dp_size = _int_field(body, "dp_size", 1, world_size)
    if world_size % dp_size:
        raise bad("out_of_range", f"world_size {world_size} is not a multiple of dp_size {dp_size}")
    return Registration(
        role=_role(body, kind),
        world_size=world_size,
        dp_size=dp_size,
        rank_ip=_host(body),
        rank_port=_int_field(body, "rank_port", 1, MAX_PORT),
        engine_rank=_int_field(body, "engine_rank", 0, world_size - 1),
        cache_layout=_layout(body, kind),
        extensions=_extensions(body.get(EXTENSIONS_KEY, [])),
    )


def _extensions(value: object) -> tuple[str, ...]:
    try:
        return check_extensions(value)
    except ValueError as exc:
        raise bad("bad_field", str(exc)) from exc


def check_extensions(value: object) -> tuple[str, ...]:
    """A ``tspd_extensions`` list: up to 16 distinct names like ``tspd.stage/2`` (sorted)."""
    if not isinstance(value, list):
        raise ValueError(f"field '{EXTENSIONS_KEY}' must be an array, got {json_type(value)}")
    if len(value) > MAX_EXTENSIONS:
        raise ValueError(f"field '{EXTENSIONS_KEY}' lists {len(value)} names; at most 16")
    for name in value:
        if not isinstance(name, str) or not _EXTENSION.fullmatch(name):
            raise ValueError(
                f"field '{EXTENSIONS_KEY}' holds {_short(name)}; names are 1..64 of "
                "a-z 0-9 . _ / - starting with a letter or digit"
            )
    return tuple(sorted(set(value)))


def _int_field(body: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad("bad_type", f"field '{key}' must be an integer, got {json_type(value)}")
    if not lo <= value <= hi:
        raise bad("out_of_range", f"field '{key}' is {_short(value)}; it must be in {lo}..{hi}")
    return value


def _role(body: Mapping[str, Any], kind: ServerKind) -> Role:
    value = body["role"]
    if not isinstance(value, str):
        raise bad("bad_type", f"field 'role' must be a string, got {json_type(value)}")
    accepted = _ROLES[kind]
    for role in accepted:
        if value.lower() == role.value.lower():
            return role
    if kind is ServerKind.KV and value.lower() == Role.ENCODE.value.lower():
        why = "encode ranks register on an embedding bootstrap server, not on a KV one"
    else:
        why = "only data-source ranks register here"
    names = " or ".join(repr(r.value) for r in accepted)
    raise bad("bad_role", f"role {_short(value)} is not accepted ({why}); use {names}")


def _host(body: Mapping[str, Any]) -> str:
    value = body["rank_ip"]
    if not isinstance(value, str):
        raise bad("bad_type", f"field 'rank_ip' must be a string, got {json_type(value)}")
    if not _HOST.fullmatch(value):
        raise bad(
            "bad_field",
            f"rank_ip {_short(value)} is not a host name or IP address "
            "(1..255 of A-Z a-z 0-9 . : - _ % [ ])",
        )
    return value


def _layout(body: Mapping[str, Any], kind: ServerKind) -> str | None:
    if kind is ServerKind.EMBEDDING:
        if body.get("cache_layout") is not None:
            raise bad(
                "bad_field",
                "this is an embedding bootstrap server: it takes no cache_layout "
                "(a prefill rank of a PD deployment registers on its own KV server)",
            )
        return None
    value = body["cache_layout"]
    if not isinstance(value, str):
        raise bad("bad_type", f"field 'cache_layout' must be a string, got {json_type(value)}")
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_LAYOUT_BYTES:
        raise bad("too_large", f"cache_layout is {size} bytes; the limit is {MAX_LAYOUT_BYTES}")
    return value


def parse_route_query(query: Mapping[str, Sequence[str]]) -> tuple[int, int]:
    """``(engine_rank, target_dp_group)`` of a ``GET /route``; ``(-1, -1)`` asks for parallel
    info. A missing or empty parameter is a 400 (wire.md §3.3), as is anything but one integer."""
    values = []
    for name in ("engine_rank", "target_dp_group"):
        given = query.get(name, ())
        if not given or not given[0]:
            raise bad(
                "missing_parameter",
                f"missing query parameter '{name}' "
                "(GET /route?engine_rank=<tp>&target_dp_group=<dp>)",
            )
        if len(given) > 1:
            raise bad("bad_query", f"query parameter '{name}' given {len(given)} times")
        if not _INT_PARAM.fullmatch(given[0]):
            raise bad("bad_query", f"{name} must be a decimal integer, got {_short(given[0])}")
        values.append(int(given[0]))
    return values[0], values[1]


def json_type(value: object) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    names = {bool: "boolean", int: "integer", float: "number", str: "string"}
    names |= {list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def _short(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- response bodies (server) -------------------------------------------------------------


def error_json(err: RegistrationError) -> dict[str, object]:
    """An error body: clients of TokenSpeed read only the status; ours also read the reason."""
    return {"status": err.status, "error": err.code, "message": err.message}


def parallel_info_json(info: ParallelInfo | None, kind: ServerKind) -> dict[str, object]:
    body: dict[str, object] = {
        "prefill_tp_size": None if info is None else info.prefill_tp_size,
        "prefill_dp_size": None if info is None else info.prefill_dp_size,
    }
    if kind is ServerKind.KV:
        body["cache_layout"] = None if info is None else info.cache_layout
    return body


def rank_address_json(address: RankAddress) -> dict[str, object]:
    body: dict[str, object] = {"rank_ip": address.rank_ip, "rank_port": address.rank_port}
    if address.extensions:
        body[EXTENSIONS_KEY] = list(address.extensions)
    return body


def deployment_json(view: DeploymentView) -> dict[str, object]:
    return {
        "kind": view.kind.value,
        "world_size": view.world_size,
        "dp_size": view.dp_size,
        "complete": view.complete,
        "registered": len(view.ranks),
        "missing": list(view.missing),
        "layout_bytes": view.layout_bytes,
        "layout_sha256": view.layout_sha256,
        "ranks": [_rank_json(entry) for entry in view.ranks],
    }


def _rank_json(entry: RankEntry) -> dict[str, object]:
    return {
        "engine_rank": entry.engine_rank,
        "dp_group": entry.dp_group,
        "tp_rank": entry.tp_rank,
        "role": entry.role.value,
        "rank_ip": entry.rank_ip,
        "rank_port": entry.rank_port,
        "registrations": entry.registrations,
        "first_registered": entry.first_registered,
        "last_registered": entry.last_registered,
        EXTENSIONS_KEY: list(entry.extensions),
    }


def registration_json(reg: Registration) -> dict[str, object]:
    """The ``PUT /route`` body a peer sends (client side)."""
    body: dict[str, object] = {
        "role": reg.role.value,
        "world_size": reg.world_size,
        "dp_size": reg.dp_size,
        "rank_ip": reg.rank_ip,
        "rank_port": reg.rank_port,
        "engine_rank": reg.engine_rank,
    }
    if reg.cache_layout is not None:
        body["cache_layout"] = reg.cache_layout
    if reg.extensions:
        body[EXTENSIONS_KEY] = list(reg.extensions)
    return body


# ---- answers (client) ---------------------------------------------------------------------


def parallel_info_from_json(body: object) -> ParallelInfo | None:
    """Parse parallel info; ``None`` when the server has no registration yet (null values).

    Unknown keys (``prefill_pp_size``, ... from newer servers) are ignored.
    """
    obj = _object(body, "parallel info")
    if obj.get("prefill_tp_size") is None and obj.get("prefill_dp_size") is None:
        return None
    world = _answer_int(obj, "prefill_tp_size", 1)
    dp = _answer_int(obj, "prefill_dp_size", 1)
    if world % dp:
        raise ValueError(f"prefill_tp_size {world} is not a multiple of prefill_dp_size {dp}")
    layout = obj.get("cache_layout")
    if layout is not None and not isinstance(layout, str):
        raise ValueError(f"cache_layout must be a string or null, got {json_type(layout)}")
    return ParallelInfo(world, dp, layout)


def rank_address_from_json(body: object) -> RankAddress:
    obj = _object(body, "rank address")
    ip = obj.get("rank_ip")
    if not isinstance(ip, str) or not ip:
        raise ValueError(f"rank_ip must be a non-empty string, got {json_type(ip)}")
    port = _answer_int(obj, "rank_port", 1)
    if port > MAX_PORT:
        raise ValueError(f"rank_port {port} is not a TCP port")
    return RankAddress(ip, port, check_extensions(obj.get(EXTENSIONS_KEY, [])))


def deployment_from_json(body: object) -> DeploymentView:
    obj = _object(body, "rank listing")
    ranks = obj.get("ranks")
    missing = obj.get("missing")
    if not isinstance(ranks, list) or not isinstance(missing, list):
        raise ValueError("rank listing needs 'ranks' and 'missing' arrays")
    try:
        return DeploymentView(
            kind=ServerKind(str(obj.get("kind"))),
            world_size=_optional_int(obj, "world_size"),
            dp_size=_optional_int(obj, "dp_size"),
            layout_bytes=_optional_int(obj, "layout_bytes"),
            layout_sha256=_optional_str(obj, "layout_sha256"),
            ranks=tuple(_rank_from_json(_object(r, "rank")) for r in ranks),
            missing=tuple(_int_value(m, "missing rank") for m in missing),
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed rank listing: {exc!r}") from exc


def _rank_from_json(obj: dict[str, Any]) -> RankEntry:
    return RankEntry(
        engine_rank=_answer_int(obj, "engine_rank", 0),
        dp_group=_answer_int(obj, "dp_group", 0),
        tp_rank=_answer_int(obj, "tp_rank", 0),
        role=Role(obj["role"]),
        rank_ip=str(obj["rank_ip"]),
        rank_port=_answer_int(obj, "rank_port", 1),
        registrations=_answer_int(obj, "registrations", 1),
        first_registered=float(obj["first_registered"]),
        last_registered=float(obj["last_registered"]),
        extensions=check_extensions(obj.get(EXTENSIONS_KEY, [])),
    )


def error_from_json(text: str) -> tuple[str | None, str]:
    """``(code, message)`` from an error body; TokenSpeed servers send plain text (no code)."""
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("message"), str):
        code = obj.get("error")
        return (code if isinstance(code, str) else None), obj["message"]
    return None, _short(text.strip() or "(empty body)", 200).strip("'\"")


def _object(body: object, what: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ValueError(f"{what} must be a JSON object, got {json_type(body)}")
    return body


def _answer_int(obj: Mapping[str, Any], key: str, lo: int) -> int:
    value = _int_value(obj.get(key), key)
    if value < lo:
        raise ValueError(f"{key} is {value}; expected >= {lo}")
    return value


def _int_value(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {json_type(value)}")
    return value


def _optional_int(obj: Mapping[str, Any], key: str) -> int | None:
    return None if obj.get(key) is None else _int_value(obj[key], key)


def _optional_str(obj: Mapping[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key} must be a string or null, got {json_type(value)}")
    return value
