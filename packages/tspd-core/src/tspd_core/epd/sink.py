"""The prefill rank's network half of EPD: find encode ranks, tell them where to write, hear back.

One control thread owns every socket and every room (no locks); the scheduler thread talks to it
through two queues and never waits on the network::

    scheduler (EmbeddingReceiver)           sink control thread                 encode rank
    ─────────────────────────────           ───────────────────                 ───────────
    advertise(Advert) ──► queue ──► route known? ── no ─► look-up thread: GET /route (bootstrap)
                                        │ yes  ◄── post(target) ──┘
                                        ├─ first time: registration (6 frames) ──────────────►
                                        └─ item info (13 frames) ────────────────────────────►
    notes() ◄── queue ◄── LANDED / FAILED ◄── status (3 frames) on the PULL socket ◄───────────
                          UNSENT (look-up or send failed: nothing was ever asked of E)

A note is final for its room: after it the encode rank never writes that room's rows again, which
is what lets the receiver free (or lift the quarantine of) the room's buffer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import IntEnum

import zmq

from tspd_bootstrap import BootstrapClient, BootstrapError
from tspd_core.epd.wire import (
    EmbeddingRegistration,
    ItemInfo,
    decode_status,
    encode_item_info,
    encode_registration,
)
from tspd_core.ids import Room
from tspd_core.pd.errors import FrameError, PdError
from tspd_core.pd.proc.control import ControlPlane
from tspd_core.pd.proc.loop import Posted
from tspd_core.pd.status import TransferPoll
from tspd_core.procname import name_this_thread

log = logging.getLogger(__name__)

TICK_S = 0.05


@dataclass(frozen=True, slots=True)
class Advert:
    """Receiver -> sink: where this rank wants the item's rows (wire.md §2.5 item info fields)."""

    room: Room
    bootstrap_host: str
    bootstrap_port: int
    dst_ptr: int
    deepstack_ptr: int
    n_rows: int
    row_start: int
    span: int

    @property
    def address(self) -> str:
        return f"{self.bootstrap_host}:{self.bootstrap_port}"


class NoteKind(IntEnum):
    LANDED = 1  #: Success from the encode rank: every row is in place
    FAILED = 2  #: Failed from the encode rank: it will not write (any more)
    UNSENT = 3  #: never reached the encode rank (look-up or send failed): nothing will be written


@dataclass(frozen=True, slots=True)
class Note:
    """Sink -> receiver: a room's final word (exactly one per advertised room)."""

    room: Room
    kind: NoteKind
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SinkIdentity:
    """What the encode ranks learn about this prefill rank."""

    host: str
    session_id: str
    tp_size: int
    tp_rank: int
    hidden: int
    dtype: str
    has_deepstack: bool
    pool_ptr: int


@dataclass(frozen=True, slots=True)
class _Target:
    ip: str
    port: int
    fanout: int


#: What a look-up finds: (address, DP group, E tp, E dp, the E rank to talk to).
_Found = tuple[str, int, int, int, _Target]


class EmbeddingSink:
    """Owns the PULL socket, the PUSH sockets and the bootstrap look-ups of one receiver."""

    def __init__(self, me: SinkIdentity, lookup_timeout_s: float, forget_after_s: float) -> None:
        self.me = me
        self.control = ControlPlane(me.host)
        self._lookup_timeout_s = lookup_timeout_s
        self._forget_after_s = forget_after_s
        self._posted = Posted()
        self._notes: queue.SimpleQueue[Note] = queue.SimpleQueue()
        self._noted = threading.Event()  # set with every note, cleared by notes()
        self._lookups = ThreadPoolExecutor(
            2, thread_name_prefix="tspd-epd-lookup", initializer=name_this_thread
        )
        self._clients: dict[str, BootstrapClient] = {}
        self._info: dict[str, tuple[int, int]] = {}  # address -> (E tp, E dp)
        self._targets: dict[tuple[str, int], _Target] = {}  # (address, dp) -> E rank
        self._waiting: dict[tuple[str, int | None], list[Advert]] = {}
        self._sent: dict[Room, Advert] = {}  # advertised, no final status yet
        self._forgotten: dict[Room, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tspd-epd-sink", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self.control.port

    # ---- the scheduler's side -----------------------------------------------------------

    def advertise(self, advert: Advert) -> None:
        """Ask the item's encode rank for this rank's rows (returns at once)."""
        self._post(lambda: self._on_advert(advert))

    def forget(self, room: Room) -> None:
        """The receiver no longer tracks ``room``; a status that still comes is still noted."""
        self._post(lambda: self._on_forget(room))

    def wait(self, timeout_s: float) -> bool:
        """Block until a note is waiting (or ``timeout_s``); for idle scheduler loops."""
        return self._noted.wait(timeout_s)

    def notes(self) -> list[Note]:
        self._noted.clear()
        out: list[Note] = []
        while True:
            try:
                out.append(self._notes.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        """Stop the thread and the look-ups; close every socket (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._post(lambda: None)
        self._thread.join(10.0)
        self._lookups.shutdown(wait=True, cancel_futures=True)
        for client in self._clients.values():
            client.close()
        self.control.close()
        self._posted.close()

    # ---- the control thread -------------------------------------------------------------

    def _run(self) -> None:
        name_this_thread()
        poller = zmq.Poller()
        poller.register(self.control.pull, zmq.POLLIN)
        poller.register(self._posted.fileno(), zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(int(TICK_S * 1000)))
            if self.control.pull in ready:
                self._drain_statuses()
            if self._posted.fileno() in ready:
                self._posted.run(_guarded)
            self._expire(time.monotonic())

    def _on_advert(self, ad: Advert) -> None:
        if ad.room in self._sent:
            self._note(ad.room, NoteKind.UNSENT, f"room {ad.room} is already advertised")
            return
        info = self._info.get(ad.address)
        dp = None if info is None else ad.room % info[1]
        target = None if dp is None else self._targets.get((ad.address, dp))
        if target is not None:
            self._send_item(ad, target)
            return
        key = (ad.address, dp)
        waiting = self._waiting.setdefault(key, [])
        waiting.append(ad)
        if len(waiting) == 1:  # the first waiter starts the look-up
            future = self._lookups.submit(self._lookup, ad.address, ad.room, dp)
            future.add_done_callback(lambda f: self._post(lambda: self._on_lookup(key, f)))

    def _on_lookup(self, key: tuple[str, int | None], future: Future[_Found]) -> None:
        waiting = self._waiting.pop(key, [])
        try:
            address, dp, e_tp, e_dp, target = future.result()
        except (BootstrapError, PdError, ValueError, OSError) as exc:
            for ad in waiting:
                self._note(ad.room, NoteKind.UNSENT, f"encode bootstrap {key[0]}: {exc}")
            return
        self._info[address] = (e_tp, e_dp)
        if (address, dp) not in self._targets:
            self._targets[(address, dp)] = target
            self._register(address, dp, target)
        for ad in waiting:
            self._on_advert(ad)  # resolves now (or looks up its own DP group)

    def _lookup(self, address: str, room: Room, dp: int | None) -> _Found:
        """On a look-up thread: the encode rank this prefill rank pulls ``room`` from."""
        client = self._client(address)
        info = client.parallel_info()
        if info is None or info.prefill_tp_size is None:
            raise FrameError("no (complete) parallel info yet: no encode rank registered")
        e_tp, e_dp = info.tp_per_dp, info.prefill_dp_size
        if e_tp < 1 or self.me.tp_size % e_tp:
            raise FrameError(f"prefill TP {self.me.tp_size} is not a multiple of encode TP {e_tp}")
        fanout = self.me.tp_size // e_tp
        group = room % e_dp if dp is None else dp
        rank = client.rank_address(self.me.tp_rank // fanout, group)
        return address, group, e_tp, e_dp, _Target(rank.rank_ip, rank.rank_port, fanout)

    def _client(self, address: str) -> BootstrapClient:
        # Only look-up threads create clients; BootstrapClient itself is thread-safe.
        client = self._clients.get(address)
        if client is None:
            client = BootstrapClient(address, timeout=self._lookup_timeout_s, retries=0)
            self._clients.setdefault(address, client)
        return self._clients[address]

    def _register(self, address: str, dp: int, target: _Target) -> None:
        me = self.me
        reg = EmbeddingRegistration(me.host, self.port, me.session_id, me.pool_ptr, me.pool_ptr)
        try:
            self.control.send(target.ip, target.port, encode_registration(reg))
        except PdError as exc:
            log.warning("cannot register with encode rank %s:%d: %s", target.ip, target.port, exc)
            self._drop_target(address, dp, target)

    def _send_item(self, ad: Advert, target: _Target) -> None:
        if ad.room in self._forgotten:
            self._note(ad.room, NoteKind.UNSENT, "forgotten before it was sent")
            return
        me = self.me
        info = ItemInfo(
            room=ad.room,
            endpoint=me.host,
            port=self.port,
            session_id=me.session_id,
            dst_ptr=ad.dst_ptr,
            deepstack_ptr=ad.deepstack_ptr,
            n_tokens=ad.n_rows,
            hidden=me.hidden,
            dtype=me.dtype,
            has_deepstack=me.has_deepstack,
            required_dst_info_num=target.fanout,
            row_start=ad.row_start,
            span=ad.span,
        )
        try:
            self.control.send(target.ip, target.port, encode_item_info(info))
        except PdError as exc:
            self._drop_target(ad.address, ad.room % self._info[ad.address][1], target)
            self._note(ad.room, NoteKind.UNSENT, f"cannot reach encode rank: {exc}")
            return
        self._sent[ad.room] = ad

    def _drop_target(self, address: str, dp: int, target: _Target) -> None:
        """A stuck encode rank: look it up (and register) again next time."""
        self._targets.pop((address, dp), None)
        self.control.forget(target.ip, target.port)

    def _on_forget(self, room: Room) -> None:
        if room in self._sent:
            self._forgotten[room] = time.monotonic()
            return
        if any(ad.room == room for ads in self._waiting.values() for ad in ads):
            self._forgotten[room] = time.monotonic()  # dropped when its look-up completes

    def _drain_statuses(self) -> None:
        for _ in range(256):
            try:
                frames = self.control.pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode_status(frames)
            except FrameError as exc:
                log.warning("rejected embedding status: %s", exc)
                continue
            if msg.room not in self._sent:
                log.debug("status %d for room %d that is not waiting", msg.status, msg.room)
            elif msg.status is TransferPoll.SUCCESS:
                self._conclude(msg.room, NoteKind.LANDED, "")
            elif msg.status is TransferPoll.FAILED:
                self._conclude(
                    msg.room, NoteKind.FAILED, f"encode rank {msg.sender_rank} failed the item"
                )

    def _conclude(self, room: Room, kind: NoteKind, reason: str) -> None:
        self._sent.pop(room, None)
        self._note(room, kind, reason)

    def _expire(self, now: float) -> None:
        # A forgotten room whose status never came: the receiver's quarantine has lapsed too.
        for room, since in list(self._forgotten.items()):
            if now - since > self._forget_after_s and room in self._sent:
                del self._sent[room], self._forgotten[room]

    def _note(self, room: Room, kind: NoteKind, reason: str) -> None:
        self._forgotten.pop(room, None)
        self._notes.put(Note(room, kind, reason))
        self._noted.set()

    def _post(self, callback: Callable[[], None]) -> None:
        self._posted.post(callback)


def _guarded(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:
        log.exception("EPD sink callback failed; still serving")
