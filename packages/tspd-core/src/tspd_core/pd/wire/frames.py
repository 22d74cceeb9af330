"""Every ZMQ frame of the PD control plane, encoded and decoded in one place (wire.md §2).

Three messages cross between P and D ranks, each a ZMQ multipart message (a list of frames):

    D → P  registration     8 frames  b"None", ip, port, session, base ptr (u64le), contract,
                                      tp size, tp rank
    D → P  pre-allocation   3 frames  room, session, manifest JSON (empty = dummy rendezvous)
    P → D  status           5 frames  room, status, sender rank, bootstrap token, spec ids
                            (3..7 accepted; frames 5-6 carry cached_tokens and a logprob)

An abort is a status message with status 0, token -1 and no spec ids (§2.4).

Between two tspd peers, three more messages run the staged transfer (gather on P, one bulk
write into a D staging slot, scatter on D). Their frame 0 is a ``tspd.*`` tag and their frame
counts differ from 3, so a TokenSpeed P drops them unread as malformed pre-allocations:

    D → P  stage offer      6 frames  tag, D session, grant, slot base ptr (u64le), slot bytes,
                                      slot count
    P → D  scatter          7 frames  tag, room, grant, slot, seq, D offsets, lengths (i64le)
    D → P  scattered        6 frames  tag, D session, grant, slot, seq, ok (1) / failed (0)

With the cluster credential (:mod:`tspd_bootstrap.auth`), a D seals its registration and its
stage offers to every P rank that announced ``tspd.auth/1`` at its bootstrap server: one more
frame, ``tspd.auth/1 <seal>``, over the message's own frames (a TokenSpeed P, which reads exactly
8 registration frames, never announces it and never gets one). The decoders take the frame
and hand its seal over unchecked (:attr:`Registration.seal`): checking it needs the secret, a
clock and the P rank's replay memory (:mod:`tspd_core.pd.prefill.seals`).

Integers are ASCII decimal without padding (``-`` only where negatives are allowed, read by
:mod:`tspd_core.pd.wire.parse`, which EPD's frames share), pointers u64 little-endian, spec ids
an int32 little-endian array, the logprob an IEEE double. Contracts and manifests stay bytes
here: their JSON belongs to :mod:`tspd_core.layout`, which parses and validates them against the
peer's layout. Decoders raise :class:`FrameError` with what was wrong; they never return
partially valid messages. Nothing here pickles.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from tspd_bootstrap.auth import AUTH_EXTENSION, FRAMES_DOMAIN, ClusterCredential
from tspd_core.ids import MAX_ROOM, Room
from tspd_core.pd.errors import FrameError
from tspd_core.pd.status import TransferPoll
from tspd_core.pd.wire.parse import (
    ascii_int,
    ascii_session,
    ascii_token,
    expect_count,
    show,
)

REGISTRATION_TAG = b"None"
MAX_ENDPOINT_CHARS = 255
MAX_CONTRACT_BYTES = 262_144
MAX_MANIFEST_BYTES = 2_097_152
MAX_TP_SIZE = 1024
#: Largest sender rank accepted in a status frame (pp_rank * tp_size + tp_rank on newer peers).
MAX_SENDER_RANK = 1 << 20
#: Speculative ids per status frame; far above any draft length in use.
MAX_SPEC_IDS = 16_384
#: ZMQ drops inbound frames above this size before Python sees them (set on every PULL socket).
MAX_FRAME_BYTES = 4 * MAX_MANIFEST_BYTES

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
    #: The cluster credential's seal over frames 0-7 (frame 8), "" when unsealed. Not part of
    #: equality: every re-registration carries a fresh seal of the same registration.
    seal: str = field(default="", compare=False)

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


STAGE_OFFER_TAG = b"tspd.stage/1"
#: Version 2 adds a promise: D handles every later status frame of the P rank only after the
#: scatters that rank requested before it, so P may send Success without waiting for the
#: scatter acknowledgements (they still free the slots).
STAGE_OFFER_ORDERED_TAG = b"tspd.stage/2"
#: What a P rank that takes D's ordered staging offers announces at the bootstrap server
#: (``tspd_extensions``); D offers staging only to P ranks whose look-up carries it, so a
#: TokenSpeed P (which would refuse the frame) never receives one.
STAGE_EXTENSION = STAGE_OFFER_ORDERED_TAG.decode("ascii")
#: How the frame a sealed registration / stage offer ends with begins (the whole frame is
#: ``tspd.auth/1 <seconds>.<nonce>.<mac>``).
SEAL_PREFIX = AUTH_EXTENSION.encode("ascii") + b" "
MAX_SEAL_FRAME_BYTES = 160
SCATTER_TAG = b"tspd.scatter/1"
SCATTERED_TAG = b"tspd.scattered/1"
#: Ranges in one scatter request (one staging slot's worth of head slices at most).
MAX_SCATTER_RANGES = 1 << 20


@dataclass(frozen=True, slots=True)
class StageOffer:
    """D → P (tspd only): staging slots ``grant .. grant+slots-1`` of D, for P's staged writes."""

    session_id: str  #: D's Mooncake session (which registration this belongs to)
    grant: int  #: D's index of the first slot granted
    base_ptr: int  #: address of the first granted slot in D's worker
    slot_bytes: int
    slots: int
    ordered: bool = False  #: D orders status frames behind earlier scatters (tspd.stage/2)
    seal: str = field(default="", compare=False)  #: over frames 0-5 (frame 6); "" = unsealed


@dataclass(frozen=True, slots=True, eq=False)
class ScatterRequest:
    """P → D (tspd only): slot ``grant + slot`` holds a room's bytes; scatter them to D's arena.

    ``dst``/``lengths`` are byte offsets from D's arena base, in the order the bytes lie in
    the slot.
    """

    room: Room
    grant: int
    slot: int
    seq: int
    dst: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class ScatterAck:
    """D → P (tspd only): the slot's bytes are in place (or were refused); the slot is free."""

    session_id: str
    grant: int
    slot: int
    seq: int
    ok: bool


def abort_message(room: Room, sender_rank: int) -> StatusMessage:
    """The Failed push P sends to every session of a room it gives up on (wire.md §2.4)."""
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


def seal_frames(frames: list[bytes], credential: ClusterCredential) -> list[bytes]:
    """``frames`` (a registration or a stage offer) with the seal frame appended."""
    seal = credential.seal(FRAMES_DOMAIN, frames)
    return [*frames, SEAL_PREFIX + seal.text.encode("ascii")]


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


def encode_stage_offer(msg: StageOffer) -> list[bytes]:
    frames = [
        STAGE_OFFER_ORDERED_TAG if msg.ordered else STAGE_OFFER_TAG,
        msg.session_id.encode("ascii"),
        str(msg.grant).encode(),
        _U64.pack(msg.base_ptr),
        str(msg.slot_bytes).encode(),
        str(msg.slots).encode(),
    ]
    decode_stage_offer(frames)
    return frames


def encode_scatter(msg: ScatterRequest) -> list[bytes]:
    head = [SCATTER_TAG, *(str(v).encode() for v in (msg.room, msg.grant, msg.slot, msg.seq))]
    frames = [*head, _i64(msg.dst), _i64(msg.lengths)]
    decode_scatter(frames)
    return frames


def encode_scattered(msg: ScatterAck) -> list[bytes]:
    nums = (msg.grant, msg.slot, msg.seq, int(msg.ok))
    return [SCATTERED_TAG, msg.session_id.encode("ascii"), *(str(v).encode() for v in nums)]


# ---------------------------------------------------------------------------------- decoders


def decode_p_inbound(
    frames: Sequence[bytes],
) -> Registration | PreAllocation | StageOffer | ScatterAck:
    """What a P rank's PULL socket receives: frame 0 ``None`` is a registration, a ``tspd.*``
    tag a staging message, anything else a pre-allocation."""
    if not frames:
        raise FrameError("empty message: expected a registration or a pre-allocation")
    tag = bytes(frames[0])
    if tag == REGISTRATION_TAG:
        return decode_registration(frames)
    if tag in (STAGE_OFFER_TAG, STAGE_OFFER_ORDERED_TAG):
        return decode_stage_offer(frames)
    if tag == SCATTERED_TAG:
        return decode_scattered(frames)
    return decode_pre_allocation(frames)


def decode_d_inbound(frames: Sequence[bytes]) -> StatusMessage | ScatterRequest:
    """What a D rank's PULL socket receives: a scatter request (tspd) or a status message."""
    if frames and bytes(frames[0]) == SCATTER_TAG:
        return decode_scatter(frames)
    return decode_status(frames)


def decode_stage_offer(frames: Sequence[bytes]) -> StageOffer:
    _expect_sealable(frames, 6, "stage offer")
    session = ascii_session(frames[1], "stage offer")
    grant = ascii_int(frames[2], "stage offer grant", 0, 1 << 20)
    if len(frames[3]) != _U64.size:
        raise FrameError(f"stage offer base pointer must be 8 bytes, got {len(frames[3])}")
    (base,) = _U64.unpack(bytes(frames[3]))
    size = ascii_int(frames[4], "stage offer slot bytes", 4096, 1 << 40)
    count = ascii_int(frames[5], "stage offer slot count", 1, 1024)
    if base == 0:
        raise FrameError("stage offer base pointer is 0")
    ordered = bytes(frames[0]) == STAGE_OFFER_ORDERED_TAG
    seal = _seal(frames[6], "stage offer") if len(frames) > 6 else ""
    return StageOffer(session, grant, base, size, count, ordered, seal)


def decode_scatter(frames: Sequence[bytes]) -> ScatterRequest:
    expect_count(frames, 7, 7, "scatter")
    room = Room(ascii_int(frames[1], "scatter room", 0, MAX_ROOM))
    grant = ascii_int(frames[2], "scatter grant", 0, 1 << 20)
    slot = ascii_int(frames[3], "scatter slot", 0, 1023)
    seq = ascii_int(frames[4], "scatter seq", 0, 2**62)
    dst, lengths = _i64_array(frames[5], "offsets"), _i64_array(frames[6], "lengths")
    if dst.size != lengths.size or not dst.size:
        raise FrameError(f"scatter has {dst.size} offsets and {lengths.size} lengths")
    if (dst < 0).any() or (lengths <= 0).any():
        raise FrameError("scatter offsets must be >= 0 and lengths > 0")
    return ScatterRequest(room, grant, slot, seq, dst, lengths)


def decode_scattered(frames: Sequence[bytes]) -> ScatterAck:
    expect_count(frames, 6, 6, "scattered")
    session = ascii_session(frames[1], "scattered")
    grant = ascii_int(frames[2], "scattered grant", 0, 1 << 20)
    slot = ascii_int(frames[3], "scattered slot", 0, 1023)
    seq = ascii_int(frames[4], "scattered seq", 0, 2**62)
    ok = ascii_int(frames[5], "scattered ok flag", 0, 1)
    return ScatterAck(session, grant, slot, seq, bool(ok))


def decode_registration(frames: Sequence[bytes]) -> Registration:
    """Parse and validate the 8 frames of a registration (wire.md §2.1), and a 9th: its seal."""
    _expect_sealable(frames, 8, "registration")
    if bytes(frames[0]) != REGISTRATION_TAG:
        raise FrameError(f"registration frame 0 must be b'None', got {show(frames[0])}")
    endpoint = ascii_token(frames[1], "registration endpoint", MAX_ENDPOINT_CHARS)
    port = ascii_int(frames[2], "registration port", 1, 65535)
    session = ascii_session(frames[3], "registration")
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
    size = ascii_int(frames[6], "registration tp size", 1, MAX_TP_SIZE)
    rank = ascii_int(frames[7], "registration tp rank", 0, size - 1)
    seal = _seal(frames[8], "registration") if len(frames) > 8 else ""
    return Registration(endpoint, port, session, base, contract, size, rank, seal)


def decode_pre_allocation(frames: Sequence[bytes]) -> PreAllocation:
    """Parse and validate the 3 frames of a pre-allocation (wire.md §2.2)."""
    expect_count(frames, 3, 3, "pre-allocation")
    room = Room(ascii_int(frames[0], "pre-allocation room", 0, MAX_ROOM))
    session = ascii_session(frames[1], "pre-allocation")
    manifest = bytes(frames[2])
    if len(manifest) > MAX_MANIFEST_BYTES:
        raise FrameError(
            f"pre-allocation manifest is {len(manifest)} bytes; at most {MAX_MANIFEST_BYTES}"
        )
    return PreAllocation(room, session, manifest)


def decode_status(frames: Sequence[bytes]) -> StatusMessage:
    """Parse and validate a status message: 3 to 7 frames, absent ones take their defaults."""
    expect_count(frames, 3, 7, "status")
    room = Room(ascii_int(frames[0], "status room", 0, MAX_ROOM))
    status = TransferPoll(ascii_int(frames[1], "status value", 0, max(TransferPoll)))
    rank = ascii_int(frames[2], "status sender rank", 0, MAX_SENDER_RANK)
    token = ascii_int(frames[3], "status bootstrap token", -1, 2**31 - 1) if len(frames) > 3 else -1
    spec = _spec_ids(frames[4]) if len(frames) > 4 else ()
    cached = ascii_int(frames[5], "status cached_tokens", 0, 2**62) if len(frames) > 5 else 0
    logprob = _logprob(frames[6]) if len(frames) > 6 else None
    return StatusMessage(room, status, rank, token, spec, cached, logprob)


# ----------------------------------------------------------------------------------- helpers


def _expect_sealable(frames: Sequence[bytes], count: int, what: str) -> None:
    if len(frames) not in (count, count + 1):
        raise FrameError(
            f"{what} needs {count} frames, got {len(frames)} (a sealed one {count + 1})"
        )


def _seal(frame: bytes, what: str) -> str:
    raw = bytes(frame)
    if not raw.startswith(SEAL_PREFIX) or len(raw) > MAX_SEAL_FRAME_BYTES:
        raise FrameError(f"{what}: its extra frame must be a 'tspd.auth/1' seal, got {show(raw)}")
    return ascii_token(raw[len(SEAL_PREFIX) :], f"{what} seal", MAX_SEAL_FRAME_BYTES)


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


def _i64(values: npt.NDArray[np.int64]) -> bytes:
    return np.ascontiguousarray(values, dtype="<i8").tobytes()


def _i64_array(frame: bytes, what: str) -> npt.NDArray[np.int64]:
    raw = bytes(frame)
    if len(raw) % 8 or len(raw) > 8 * MAX_SCATTER_RANGES:
        raise FrameError(f"scatter {what} must be int64 LE, at most {MAX_SCATTER_RANGES}")
    return np.frombuffer(raw, dtype="<i8").astype(np.int64)
