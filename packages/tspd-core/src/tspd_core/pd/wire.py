"""Every ZMQ frame of the PD control plane, encoded and decoded in one place (WIRE.md §2).

Three messages cross between P and D ranks, each a ZMQ multipart message (a list of frames):

    D → P  registration     8 frames  b"None", ip, port, session, base ptr (u64le), contract,
                                      tp size, tp rank
    D → P  pre-allocation   3 frames  room, session, manifest JSON (empty = dummy rendezvous)
    P → D  status           5 frames  room, status, sender rank, bootstrap token, spec ids
                            (3..7 accepted; frames 5-6 carry cached_tokens and a logprob)

An abort is a status message with status 0, token -1 and no spec ids (§2.4).

Integers are ASCII decimal without padding (``-`` only where negatives are allowed),
pointers u64 little-endian, spec ids an int32 little-endian array, the logprob an IEEE double.
Contracts and manifests stay bytes here: their JSON belongs to :mod:`tspd_core.layout`, which
parses and validates them against the peer's layout. Decoders raise :class:`FrameError` with
what was wrong; they never return partially valid messages. Nothing here pickles.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from tspd_core.ids import MAX_ROOM, Room
from tspd_core.pd.errors import FrameError
from tspd_core.pd.status import TransferPoll

REGISTRATION_TAG = b"None"
MAX_ENDPOINT_CHARS = 255
MAX_SESSION_CHARS = 512
MAX_CONTRACT_BYTES = 262_144
MAX_MANIFEST_BYTES = 2_097_152
MAX_TP_SIZE = 1024
#: Largest sender rank accepted in a status frame (pp_rank * tp_size + tp_rank on newer peers).
MAX_SENDER_RANK = 1 << 20
#: Speculative ids per status frame; far above any draft length in use.
MAX_SPEC_IDS = 16_384
#: ZMQ drops inbound frames above this size before Python sees them (set on every PULL socket).
MAX_FRAME_BYTES = 4 * MAX_MANIFEST_BYTES

_INT_RE = re.compile(rb"-?(?:0|[1-9][0-9]{0,19})")
_TOKEN_RE = re.compile(rb"[!-~]+")  # printable ASCII, no spaces
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")


@dataclass(frozen=True, slots=True)
class Registration:
    """D → P, once per (bootstrap address, P DP group, target set): where D's arena lives."""

    endpoint: str  #: D's IP, where P pushes status frames
    port: int  #: D's PULL port
    session_id: str  #: D's Mooncake session id, ``"<ip>:<rpc_port>"``
    base_ptr: int  #: D's arena base address in D's transfer worker
    contract: bytes  #: D's canonical cache transfer contract (JSON)
    tp_size: int
    tp_rank: int

    @property
    def rpc_port(self) -> int:
        """The Mooncake RPC port: the integer after the session id's first ``:``."""
        return int(self.session_id.split(":", 1)[1])


@dataclass(frozen=True, slots=True)
class PreAllocation:
    """D → P, once per (room, D rank): the destination manifest, or empty for a dummy P rank."""

    room: Room
    session_id: str
    manifest: bytes

    @property
    def is_dummy(self) -> bool:
        """An empty manifest is the dummy rendezvous a P rank serving no D rank receives."""
        return not self.manifest


@dataclass(frozen=True, slots=True)
class StatusMessage:
    """P → D: a room's final state from one P rank (Success with the first token, or Failed)."""

    room: Room
    status: TransferPoll
    sender_rank: int
    bootstrap_token: int = -1  #: the first output token, -1 = none
    spec_ids: tuple[int, ...] = ()  #: speculative candidate ids; empty = none
    cached_tokens: int = 0  #: P's prefix-cache hit (frame 5, newer peers)
    bootstrap_logprob: float | None = None  #: logprob of the first token (frame 6, newer peers)


def abort_message(room: Room, sender_rank: int) -> StatusMessage:
    """The Failed push P sends to every session of a room it gives up on (WIRE.md §2.4)."""
    return StatusMessage(room=room, status=TransferPoll.FAILED, sender_rank=sender_rank)


# ---------------------------------------------------------------------------------- encoders


def encode_registration(msg: Registration) -> list[bytes]:
    """Frames of a registration; validates like the decoder so we never send what we reject."""
    frames = [
        REGISTRATION_TAG,
        msg.endpoint.encode("ascii"),
        str(msg.port).encode(),
        msg.session_id.encode("ascii"),
        _U64.pack(msg.base_ptr),
        msg.contract,
        str(msg.tp_size).encode(),
        str(msg.tp_rank).encode(),
    ]
    decode_registration(frames)
    return frames


def encode_pre_allocation(msg: PreAllocation) -> list[bytes]:
    """Frames of a pre-allocation (an empty manifest makes it the dummy rendezvous)."""
    frames = [str(msg.room).encode(), msg.session_id.encode("ascii"), msg.manifest]
    decode_pre_allocation(frames)
    return frames


def encode_status(msg: StatusMessage) -> list[bytes]:
    """Frames of a status message: 5 frames, or 7 when cached_tokens or a logprob is set.

    Older Python peers read frames 0-4 and ignore the rest, so the 7-frame form is safe.
    """
    frames = [
        str(msg.room).encode(),
        str(int(msg.status)).encode(),
        str(msg.sender_rank).encode(),
        str(msg.bootstrap_token).encode(),
        b"".join(struct.pack("<i", i) for i in msg.spec_ids),
    ]
    if msg.cached_tokens or msg.bootstrap_logprob is not None:
        frames.append(str(msg.cached_tokens).encode())
        frames.append(b"" if msg.bootstrap_logprob is None else _F64.pack(msg.bootstrap_logprob))
    decode_status(frames)
    return frames


# ---------------------------------------------------------------------------------- decoders


def decode_prefill_inbound(frames: Sequence[bytes]) -> Registration | PreAllocation:
    """What a P rank's PULL socket receives: frame 0 ``None`` is a registration, else a room."""
    if not frames:
        raise FrameError("empty message: expected a registration or a pre-allocation")
    if bytes(frames[0]) == REGISTRATION_TAG:
        return decode_registration(frames)
    return decode_pre_allocation(frames)


def decode_registration(frames: Sequence[bytes]) -> Registration:
    """Parse and validate the 8 frames of a registration (WIRE.md §2.1)."""
    _expect_count(frames, 8, 8, "registration")
    if bytes(frames[0]) != REGISTRATION_TAG:
        raise FrameError(f"registration frame 0 must be b'None', got {_show(frames[0])}")
    endpoint = _ascii_token(frames[1], "registration endpoint", MAX_ENDPOINT_CHARS)
    port = _int(frames[2], "registration port", 1, 65535)
    session = _session(frames[3], "registration")
    if len(frames[4]) != _U64.size:
        raise FrameError(f"registration base pointer must be 8 bytes, got {len(frames[4])}")
    (base,) = _U64.unpack(bytes(frames[4]))
    if base == 0:
        raise FrameError("registration base pointer is 0: D's arena is not registered")
    contract = bytes(frames[5])
    if not 0 < len(contract) <= MAX_CONTRACT_BYTES:
        raise FrameError(
            f"registration contract is {len(contract)} bytes; allowed 1..{MAX_CONTRACT_BYTES}"
        )
    size = _int(frames[6], "registration tp size", 1, MAX_TP_SIZE)
    rank = _int(frames[7], "registration tp rank", 0, size - 1)
    return Registration(endpoint, port, session, base, contract, size, rank)


def decode_pre_allocation(frames: Sequence[bytes]) -> PreAllocation:
    """Parse and validate the 3 frames of a pre-allocation (WIRE.md §2.2)."""
    _expect_count(frames, 3, 3, "pre-allocation")
    room = Room(_int(frames[0], "pre-allocation room", 0, MAX_ROOM))
    session = _session(frames[1], "pre-allocation")
    manifest = bytes(frames[2])
    if len(manifest) > MAX_MANIFEST_BYTES:
        raise FrameError(
            f"pre-allocation manifest is {len(manifest)} bytes; at most {MAX_MANIFEST_BYTES}"
        )
    return PreAllocation(room, session, manifest)


def decode_status(frames: Sequence[bytes]) -> StatusMessage:
    """Parse and validate a status message: 3 to 7 frames, absent ones take their defaults."""
    _expect_count(frames, 3, 7, "status")
    room = Room(_int(frames[0], "status room", 0, MAX_ROOM))
    status = TransferPoll(_int(frames[1], "status value", 0, max(TransferPoll)))
    rank = _int(frames[2], "status sender rank", 0, MAX_SENDER_RANK)
    token = _int(frames[3], "status bootstrap token", -1, 2**31 - 1) if len(frames) > 3 else -1
    spec = _spec_ids(frames[4]) if len(frames) > 4 else ()
    cached = _int(frames[5], "status cached_tokens", 0, 2**62) if len(frames) > 5 else 0
    logprob = _logprob(frames[6]) if len(frames) > 6 else None
    return StatusMessage(room, status, rank, token, spec, cached, logprob)


# ----------------------------------------------------------------------------------- helpers


def _expect_count(frames: Sequence[bytes], lo: int, hi: int, what: str) -> None:
    n = len(frames)
    if not lo <= n <= hi:
        want = str(lo) if lo == hi else f"{lo}..{hi}"
        raise FrameError(f"{what} needs {want} frames, got {n}")


def _int(frame: bytes, what: str, lo: int, hi: int) -> int:
    raw = bytes(frame)
    if not _INT_RE.fullmatch(raw) or raw == b"-0":
        raise FrameError(f"{what} must be an ASCII integer without padding, got {_show(raw)}")
    value = int(raw)
    if not lo <= value <= hi:
        raise FrameError(f"{what} {value} is outside {lo}..{hi}")
    return value


def _ascii_token(frame: bytes, what: str, limit: int) -> str:
    raw = bytes(frame)
    if not 0 < len(raw) <= limit or not _TOKEN_RE.fullmatch(raw):
        raise FrameError(f"{what} must be 1..{limit} printable ASCII chars, got {_show(raw)}")
    return raw.decode("ascii")


def _session(frame: bytes, what: str) -> str:
    session = _ascii_token(frame, f"{what} session id", MAX_SESSION_CHARS)
    host, sep, port = session.partition(":")
    if not sep or not host:
        raise FrameError(f"{what} session id must be '<ip>:<rpc_port>', got {session!r}")
    _int(port.encode(), f"{what} session id port", 1, 65535)
    return session


def _spec_ids(frame: bytes) -> tuple[int, ...]:
    raw = bytes(frame)
    if len(raw) % 4 or len(raw) > 4 * MAX_SPEC_IDS:
        raise FrameError(
            f"status spec ids must be int32 LE, at most {MAX_SPEC_IDS}; got {len(raw)} bytes"
        )
    return tuple(v for (v,) in struct.iter_unpack("<i", raw))


def _logprob(frame: bytes) -> float | None:
    raw = bytes(frame)
    if not raw:
        return None
    if len(raw) != _F64.size:
        raise FrameError(f"status logprob must be 8 bytes (f64 LE) or empty, got {len(raw)}")
    (value,) = _F64.unpack(raw)
    if math.isnan(value) or value > 0.0:
        raise FrameError(f"status logprob must be a log-probability (<= 0), got {value}")
    return float(value)


def _show(raw: bytes, limit: int = 32) -> str:
    """A short, log-safe rendering of an offending frame."""
    raw = bytes(raw)
    head = repr(raw[:limit])
    return head if len(raw) <= limit else f"{head}... ({len(raw)} bytes)"
