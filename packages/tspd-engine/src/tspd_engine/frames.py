"""Every frame the engine sends between processes, encoded and checked in one place.

Two channels, both JSON (no pickle on the wire), both size-limited:

* **front door** (ZMQ): a client PUSHes :class:`Submit` / :class:`Abort` / :class:`RoomAbort` /
  :class:`Shutdown` / :class:`Query` to rank 0; rank 0 PUSHes :class:`Output` frames to the
  reply address each submit names, and a :class:`Stats` frame to the address each query names.
* **round frame** (gloo broadcast from rank 0 to the other ranks of the TP group): the
  :class:`Round` of intake events every rank applies before its next scheduler round, so all
  ranks admit and abort the same requests in the same order and keep identical block tables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from tspd_core.ids import MAX_ROOM
from tspd_serving.errors import RequestError
from tspd_serving.tokenizer import MAX_TOKEN_ID

MAX_FRAME_BYTES = 64 << 20
MAX_RID_CHARS = 256
MAX_HOST_CHARS = 255
#: Longest ZMQ reply address a frame may name (``tcp://host:port``).
MAX_REPLY_CHARS = 300
#: Longest reason a :class:`RoomAbort` carries (it ends up in the transfer worker's log).
MAX_REASON_CHARS = 200


class FinishReason(IntEnum):
    """Why a request stopped; ``NONE`` while it is still generating."""

    NONE = 0
    EOS = 1  # an EOS or stop token was generated (and is included in the output)
    LENGTH = 2  # max_tokens reached
    ABORT = 3  # the client aborted it
    ERROR = 4  # the engine refused or failed it; ``error`` says why
    #: Its PD KV transfer failed (peer down, timeout, abort from the other side): a
    #: server-side failure, unlike ERROR's refusals; another P/D pair may well succeed.
    TRANSFER = 5


class RequestMode(IntEnum):
    """What the engine does with a request (PD hooks: see docs/engine.md)."""

    GENERATE = 0  # prefill and decode here (colocated)
    PREFILL_ONLY = 1  # PD prefill node: prefill, emit the first token, hold pages until released
    REMOTE_DECODE = 2  # PD decode node: prompt KV arrives remotely, decode from a seeded token


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Greedy decoding controls (the reference engine samples greedily)."""

    max_tokens: int = 16
    #: EOS (and stop ids) are masked out of the argmax until this many tokens exist.
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must lie in 0..max_tokens, got {self.min_tokens}")
        if not all(0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids):
            raise RequestError(f"stop token ids must lie in 0..{MAX_TOKEN_ID}")


@dataclass(frozen=True, slots=True)
class PdTarget:
    """Where a PD request's two halves meet: its room and the P instance's bootstrap server.

    The router draws the room (0..2**63-1) and sends the same target to the P and the D node.
    """

    room: int
    bootstrap_host: str
    bootstrap_port: int

    def __post_init__(self) -> None:
        if type(self.room) is not int or not 0 <= self.room <= MAX_ROOM:
            raise RequestError(f"room must be an integer in 0..2**63-1, got {self.room!r}")
        host = self.bootstrap_host
        if not isinstance(host, str) or not 0 < len(host) <= MAX_HOST_CHARS:
            raise RequestError(f"bootstrap host must be 1..{MAX_HOST_CHARS} characters")
        if type(self.bootstrap_port) is not int or not 1 <= self.bootstrap_port <= 65535:
            raise RequestError(f"bootstrap port must lie in 1..65535, got {self.bootstrap_port!r}")


@dataclass(frozen=True, slots=True)
class Submit:
    """A new request: prompt token ids and sampling parameters."""

    rid: str
    prompt: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    reply: str = ""  # ZMQ address rank 0 PUSHes outputs to ("" inside the round frame)
    mode: RequestMode = RequestMode.GENERATE
    #: PD halves only: the room and bootstrap server shared with the other half.
    pd: PdTarget | None = None


@dataclass(frozen=True, slots=True)
class Abort:
    rid: str


@dataclass(frozen=True, slots=True)
class RoomAbort:
    """Fail a PD room that no request of the replica holds (a prefill node refused the request
    that carried it, or never saw it): every rank's transfer worker fails the room, so the D
    ranks that pre-allocated it get Failed pushed (wire.md §2.4) and free their pages now
    rather than at P's bootstrap timeout. A room a request of the replica holds is left alone
    (its request's own abort is the way to end it); an unknown room is only remembered as
    aborted, so a later pre-allocation of it is answered Failed."""

    room: int
    reason: str = "refused by the prefill node"

    def __post_init__(self) -> None:
        if type(self.room) is not int or not 0 <= self.room <= MAX_ROOM:
            raise RequestError(f"room must be an integer in 0..2**63-1, got {self.room!r}")
        if not isinstance(self.reason, str) or not 0 < len(self.reason) <= MAX_REASON_CHARS:
            raise RequestError(f"a room abort's reason must be 1..{MAX_REASON_CHARS} characters")


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class Query:
    """Ask rank 0 for its counters; answered with a :class:`Stats` frame carrying ``qid``."""

    reply: str
    qid: int


@dataclass(frozen=True, slots=True)
class Stats:
    """Rank 0's counters (KV pool, queue lengths, PD transfers) at the end of a round."""

    qid: int
    values: dict[str, float]


@dataclass(frozen=True, slots=True)
class Output:
    """New tokens of one request since the last output (the last one has ``finished``)."""

    rid: str
    tokens: tuple[int, ...]
    finish: FinishReason = FinishReason.NONE
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish != FinishReason.NONE


#: What a round carries: the intake events every rank applies in order.
Event = Submit | Abort | RoomAbort


@dataclass(frozen=True, slots=True)
class Round:
    """The intake events of one scheduler round, in the order rank 0 received them."""

    events: tuple[Event, ...] = ()
    shutdown: bool = False


Frame = Submit | Abort | RoomAbort | Shutdown | Query | Stats | Output | Round


def encode(frame: Frame) -> bytes:
    return json.dumps(_to_json(frame), separators=(",", ":")).encode()


def decode(data: bytes) -> Frame:
    """Parse one frame; raises :class:`RequestError` saying what is wrong with it, and nothing
    else, whatever ``data`` holds (a frame may come from any local process)."""
    if len(data) > MAX_FRAME_BYTES:
        raise RequestError(f"frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        return _from_json(json.loads(data))
    except RequestError:
        raise
    except RecursionError:  # b"[" * 100_000: json recurses once per nesting level
        raise RequestError("malformed frame: nested too deeply") from None
    except (ValueError, KeyError, TypeError, OverflowError) as exc:
        raise RequestError(f"malformed frame: {exc!r}"[:300]) from exc


def _to_json(frame: Frame) -> dict[str, Any]:
    if isinstance(frame, Submit):
        p = frame.params
        params = [p.max_tokens, p.min_tokens, list(p.stop_token_ids), p.ignore_eos]
        return {
            "op": "submit",
            "rid": frame.rid,
            "prompt": list(frame.prompt),
            "params": params,
            "reply": frame.reply,
            "mode": int(frame.mode),
            "pd": None if frame.pd is None else _pd_json(frame.pd),
        }
    if isinstance(frame, Abort):
        return {"op": "abort", "rid": frame.rid}
    if isinstance(frame, RoomAbort):
        return {"op": "abort_room", "room": frame.room, "reason": frame.reason}
    if isinstance(frame, Shutdown):
        return {"op": "shutdown"}
    if isinstance(frame, Query):
        return {"op": "query", "reply": frame.reply, "qid": frame.qid}
    if isinstance(frame, Stats):
        return {"op": "stats", "qid": frame.qid, "values": frame.values}
    if isinstance(frame, Output):
        return {
            "op": "output",
            "rid": frame.rid,
            "tokens": list(frame.tokens),
            "finish": int(frame.finish),
            "error": frame.error,
            "prompt_tokens": frame.prompt_tokens,
            "cached_tokens": frame.cached_tokens,
        }
    events = [_to_json(e) for e in frame.events]
    return {"op": "round", "events": events, "shutdown": frame.shutdown}


def _from_json(raw: Any) -> Frame:
    if not isinstance(raw, dict):
        raise RequestError("frame must be a JSON object")
    op = raw["op"]
    if op == "submit":
        mode = raw.get("mode", 0)
        if type(mode) is not int or mode not in RequestMode.__members__.values():
            raise RequestError(f"unknown request mode {mode!r}")
        params = _params(raw["params"])
        pd = _pd(raw.get("pd"))
        reply = _reply(raw["reply"])
        return Submit(_rid(raw), _ids(raw["prompt"]), params, reply, RequestMode(mode), pd)
    if op == "abort":
        return Abort(_rid(raw))
    if op == "abort_room":
        return RoomAbort(raw["room"], raw["reason"])
    if op == "shutdown":
        return Shutdown()
    if op == "query":
        return Query(_reply(raw["reply"]), _int(raw["qid"], "qid"))
    if op == "stats":
        return Stats(_int(raw["qid"], "qid"), _values(raw["values"]))
    if op == "output":
        if not isinstance(raw["error"], str):
            raise RequestError("output error must be a string")
        return Output(
            _rid(raw),
            _ids(raw["tokens"]),
            FinishReason(_int(raw["finish"], "finish")),
            raw["error"],
            _int(raw["prompt_tokens"], "prompt_tokens"),
            _int(raw["cached_tokens"], "cached_tokens"),
        )
    if op == "round":
        if not isinstance(raw["events"], list):
            raise RequestError("round events must be a list")
        events = tuple(_from_json(e) for e in raw["events"])
        if not all(isinstance(e, Submit | Abort | RoomAbort) for e in events):
            raise RequestError("a round frame carries only submit, abort and abort_room events")
        return Round(events, bool(raw["shutdown"]))  # type: ignore[arg-type]
    raise RequestError(f"unknown frame op {repr(op)[:40]}")


def _rid(raw: dict[str, Any]) -> str:
    rid = raw["rid"]
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_RID_CHARS:
        raise RequestError(f"request id must be a string of 1..{MAX_RID_CHARS} chars")
    return rid


def _ids(raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in raw):
        raise RequestError(f"token ids must be a list of integers in 0..{MAX_TOKEN_ID}")
    return tuple(raw)


def _reply(raw: Any) -> str:
    if not isinstance(raw, str) or len(raw) > MAX_REPLY_CHARS:
        raise RequestError(f"reply address must be a string of at most {MAX_REPLY_CHARS} chars")
    return raw


def _params(raw: Any) -> SamplingParams:
    if not isinstance(raw, list) or len(raw) != 4:
        raise RequestError("params must be [max_tokens, min_tokens, stop_ids, ignore_eos]")
    max_tokens, min_tokens, stop, ignore_eos = raw
    if type(max_tokens) is not int or type(min_tokens) is not int:
        raise RequestError("max_tokens and min_tokens must be integers")
    return SamplingParams(max_tokens, min_tokens, _ids(stop), bool(ignore_eos))


def _pd_json(pd: PdTarget) -> list[Any]:
    return [pd.room, pd.bootstrap_host, pd.bootstrap_port]


def _pd(raw: Any) -> PdTarget | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != 3:
        raise RequestError("pd must be [room, bootstrap_host, bootstrap_port] or null")
    return PdTarget(raw[0], raw[1], raw[2])


def _int(raw: Any, what: str) -> int:
    if type(raw) is not int:
        raise RequestError(f"{what} must be an integer")
    return raw


def _values(raw: Any) -> dict[str, float]:
    ok = isinstance(raw, dict) and all(
        isinstance(k, str) and type(v) in (int, float) for k, v in raw.items()
    )
    if not ok:
        raise RequestError("stats values must be an object of numbers")
    return dict(raw)
