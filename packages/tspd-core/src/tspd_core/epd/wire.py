"""Every ZMQ frame of EPD (encode -> prefill embeddings), encoded and decoded here (wire.md §2.5).

Three messages, each a ZMQ multipart message::

    P -> E  registration   6 frames   b"None", P ip, P port, P session id, embedding base ptr
                                      (u64le), deepstack base ptr (u64le)
    P -> E  item info     13 frames   room, P ip, P port, P session id, destination ptr (u64le,
                                      at this rank's first row), deepstack ptr (u64le, 0 = none),
                                      n_tokens (rows wanted, may be 0), hidden, dtype
                                      (``torch.bfloat16``), has_deepstack (1/0),
                                      required_dst_info_num (= fan-out), row_start, span
                                      (frames past 13 are ignored, as TokenSpeed does)
    E -> P  status         3 frames   room, status (5 Success / 0 Failed), E global rank

It reuses the PD codec's integer, token and session parsers (:mod:`tspd_core.pd.wire.frames`),
so both planes accept exactly the same spelling of an integer or a session id. Decoders check
syntax and ranges and raise :class:`FrameError`; what a frame means for a room (does its span
match the chunk, do the shards tile) is checked by the encode side's room logic, which can then
fail the room loudly instead of dropping a frame silently. Nothing here pickles.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from tspd_core.epd.items import MAX_ROWS, MAX_WIDTH
from tspd_core.ids import MAX_ROOM, Room
from tspd_core.pd.errors import FrameError
from tspd_core.pd.status import TransferPoll
from tspd_core.pd.wire.frames import (
    MAX_ENDPOINT_CHARS,
    MAX_SENDER_RANK,
    MAX_TP_SIZE,
    REGISTRATION_TAG,
)
from tspd_core.pd.wire.parse import ascii_int, ascii_session, ascii_token, expect_count, show

ITEM_INFO_FRAMES = 13
#: Extra frames an item info may carry (newer peers); more is a malformed message.
MAX_EXTRA_FRAMES = 16
_U64 = struct.Struct("<Q")
_DTYPE_RE = re.compile(rb"torch\.[a-z][a-z0-9_]{0,39}")


@dataclass(frozen=True, slots=True)
class EmbeddingRegistration:
    """P -> E, once per (bootstrap address, DP group, E rank) per P receiver.

    TokenSpeed's P sends 0 pointers and its E ignores the content; so do we (the pointers of
    each item travel in its item info).
    """

    endpoint: str  #: P's IP, where E pushes status frames
    port: int  #: P's PULL port
    session_id: str  #: P's Mooncake session id
    embedding_ptr: int = 0
    deepstack_ptr: int = 0


@dataclass(frozen=True, slots=True)
class ItemInfo:
    """P -> E, one per (room, P rank): where and how many rows of the item to write."""

    room: Room
    endpoint: str
    port: int
    session_id: str
    dst_ptr: int  #: already at this rank's first row
    deepstack_ptr: int  #: 0 when the item has no deepstack part
    n_tokens: int  #: rows this rank wants (its shard, or the whole span)
    hidden: int
    dtype: str  #: Python's ``str(torch dtype)``
    has_deepstack: bool
    required_dst_info_num: int  #: how many P ranks this E rank serves for the room (fan-out)
    row_start: int
    span: int  #: the item's full row count

    @property
    def is_identity(self) -> bool:
        return self.row_start == 0 and self.n_tokens == self.span


@dataclass(frozen=True, slots=True)
class EmbeddingStatus:
    """E -> P: the room's rows for this P rank all landed (Success) or never will (Failed)."""

    room: Room
    status: TransferPoll
    sender_rank: int  #: E global rank


# ---------------------------------------------------------------------------------- encoders


def encode_registration(msg: EmbeddingRegistration) -> list[bytes]:
    """The 6 frames of a registration (validated like the decoder)."""
    frames = [
        REGISTRATION_TAG,
        msg.endpoint.encode("ascii"),
        str(msg.port).encode(),
        msg.session_id.encode("ascii"),
        _U64.pack(msg.embedding_ptr),
        _U64.pack(msg.deepstack_ptr),
    ]
    decode_registration(frames)
    return frames


def encode_item_info(msg: ItemInfo) -> list[bytes]:
    """The 13 frames of an item info (validated like the decoder)."""
    frames = [
        str(msg.room).encode(),
        msg.endpoint.encode("ascii"),
        str(msg.port).encode(),
        msg.session_id.encode("ascii"),
        _U64.pack(msg.dst_ptr),
        _U64.pack(msg.deepstack_ptr),
        str(msg.n_tokens).encode(),
        str(msg.hidden).encode(),
        msg.dtype.encode("ascii"),
        b"1" if msg.has_deepstack else b"0",
        str(msg.required_dst_info_num).encode(),
        str(msg.row_start).encode(),
        str(msg.span).encode(),
    ]
    decode_item_info(frames)
    return frames


def encode_status(msg: EmbeddingStatus) -> list[bytes]:
    """The 3 frames of a status push."""
    frames = [str(msg.room).encode(), str(int(msg.status)).encode(), str(msg.sender_rank).encode()]
    decode_status(frames)
    return frames


# ---------------------------------------------------------------------------------- decoders


def decode_encode_inbound(frames: Sequence[bytes]) -> EmbeddingRegistration | ItemInfo:
    """What an E rank's PULL socket receives: frame 0 ``None`` is a registration, else an item."""
    if not frames:
        raise FrameError("empty message: expected an embedding registration or an item info")
    if bytes(frames[0]) == REGISTRATION_TAG:
        return decode_registration(frames)
    return decode_item_info(frames)


def decode_registration(frames: Sequence[bytes]) -> EmbeddingRegistration:
    """Parse and validate the 6 frames of a registration."""
    expect_count(frames, 6, 6, "embedding registration")
    if bytes(frames[0]) != REGISTRATION_TAG:
        raise FrameError(f"embedding registration frame 0 must be b'None', got {show(frames[0])}")
    endpoint = ascii_token(frames[1], "embedding registration endpoint", MAX_ENDPOINT_CHARS)
    port = ascii_int(frames[2], "embedding registration port", 1, 65535)
    session = ascii_session(frames[3], "embedding registration")
    emb = _ptr(frames[4], "embedding registration embedding pointer")
    deep = _ptr(frames[5], "embedding registration deepstack pointer")
    return EmbeddingRegistration(endpoint, port, session, emb, deep)


def decode_item_info(frames: Sequence[bytes]) -> ItemInfo:
    """Parse and validate an item info: 13 frames, up to 16 extra ones ignored."""
    expect_count(frames, ITEM_INFO_FRAMES, ITEM_INFO_FRAMES + MAX_EXTRA_FRAMES, "item info")
    room = Room(ascii_int(frames[0], "item info room", 0, MAX_ROOM))
    endpoint = ascii_token(frames[1], "item info endpoint", MAX_ENDPOINT_CHARS)
    port = ascii_int(frames[2], "item info port", 1, 65535)
    session = ascii_session(frames[3], "item info")
    dst = _ptr(frames[4], "item info destination pointer")
    deep = _ptr(frames[5], "item info deepstack pointer")
    n_tokens = ascii_int(frames[6], "item info n_tokens", 0, MAX_ROWS)
    hidden = ascii_int(frames[7], "item info hidden", 1, MAX_WIDTH)
    dtype = bytes(frames[8])
    if not _DTYPE_RE.fullmatch(dtype):
        raise FrameError(f"item info dtype must look like b'torch.bfloat16', got {show(dtype)}")
    flag = bytes(frames[9])
    if flag not in (b"0", b"1"):
        raise FrameError(f"item info has_deepstack must be b'1' or b'0', got {show(flag)}")
    required = ascii_int(frames[10], "item info required_dst_info_num", 1, MAX_TP_SIZE)
    row_start = ascii_int(frames[11], "item info row_start", 0, MAX_ROWS)
    span = ascii_int(frames[12], "item info span", 0, MAX_ROWS)
    has_deep = flag == b"1"
    if n_tokens and not dst:
        raise FrameError(f"item info of room {room}: {n_tokens} rows wanted at pointer 0")
    if n_tokens and has_deep and not deep:
        raise FrameError(f"item info of room {room}: deepstack wanted at pointer 0")
    if deep and not has_deep:
        raise FrameError(f"item info of room {room}: a deepstack pointer without has_deepstack")
    return ItemInfo(
        room=room,
        endpoint=endpoint,
        port=port,
        session_id=session,
        dst_ptr=dst,
        deepstack_ptr=deep,
        n_tokens=n_tokens,
        hidden=hidden,
        dtype=dtype.decode(),
        has_deepstack=has_deep,
        required_dst_info_num=required,
        row_start=row_start,
        span=span,
    )


def decode_status(frames: Sequence[bytes]) -> EmbeddingStatus:
    """Parse and validate the 3 frames of a status push."""
    expect_count(frames, 3, 3, "embedding status")
    room = Room(ascii_int(frames[0], "embedding status room", 0, MAX_ROOM))
    status = TransferPoll(ascii_int(frames[1], "embedding status value", 0, max(TransferPoll)))
    rank = ascii_int(frames[2], "embedding status sender rank", 0, MAX_SENDER_RANK)
    return EmbeddingStatus(room, status, rank)


def _ptr(frame: bytes, what: str) -> int:
    raw = bytes(frame)
    if len(raw) != _U64.size:
        raise FrameError(f"{what} must be 8 bytes (u64 LE), got {len(raw)}")
    value: int = _U64.unpack(raw)[0]
    return value
