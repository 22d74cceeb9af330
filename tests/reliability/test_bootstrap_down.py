"""The bootstrap server down at start and mid-run, with real peers.

At start: a D room whose P instance has no bootstrap server yet fails at once (look-up), and
once the server and its P rank are up the next room moves byte-exact. Mid-run: D's heartbeat
declares the P instance dead within its bound, fails its waiting room (pages back to the
pool), drops the cached routes and registrations — so when a new P instance comes up behind a
new server at the same address, the next room finds it and moves byte-exact.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from tspd_bootstrap.server import BootstrapServer
from tspd_core.ids import RequestId, Room
from tspd_core.layout import (
    ArenaSpec,
    build_contract,
    build_manifest,
    canonical_contract,
    encode_contract,
)
from tspd_core.pd import (
    BootstrapInfo,
    Bootstrapped,
    DecodeOutbox,
    Failed,
    FirstToken,
    PdTunables,
    PrefillOutbox,
    PrefillPeer,
    PrefillPeerConfig,
    RemoteDecodeRow,
    RemotePrefill,
    RemotePrefillRow,
    Succeeded,
    TransferPeer,
)
from tspd_core.pd.decode.heartbeat import bound_for
from tspd_core.sched import BlockPool
from tspd_testing.identity import RankView, check_identity, fill_identity
from tspd_testing.loopback import LoopbackCluster
from tspd_testing.loopback import poll_events as _events

SPEC = ArenaSpec(layers=2, kv_heads=4, head_dim=8, page_size=4, num_pages=64)
FAST = PdTunables(heartbeat_interval_s=2.0, heartbeat_max_failure=1, bootstrap_timeout_s=30)
#: 1 x (2 s + a 2 s connect + a 3 s read) = 7 s, + a sweep tick and a poll round.
BOUND_S = bound_for(FAST.heartbeat_interval_s, FAST.heartbeat_max_failure) + 1.0


def _canonical(text: str) -> str:
    return canonical_contract(text.encode()).decode()


@contextmanager
def _held_port(port: int = 0) -> Iterator[int]:
    """A loopback port (``port``, or one the system picks) held for the block with nothing
    listening on it: connecting is refused, and no other process can take it. Bound with
    SO_REUSEADDR, as the bootstrap server binds, so a server the test starts there may bind
    it too."""
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", port))
        yield int(held.getsockname()[1])


Prefill = tuple[PrefillPeer, PrefillOutbox, RankView]


def _prefill(url: str) -> Prefill:
    contract = build_contract(SPEC)
    arena = torch.zeros(contract.plan.arena_bytes, dtype=torch.uint8)
    config = PrefillPeerConfig(
        contract=encode_contract(contract).decode(),
        arena=arena,
        host="127.0.0.1",
        tunables=FAST,
        bootstrap_url=url,
    )
    peer, outbox = PrefillPeer.start(config)
    return peer, outbox, RankView(arena.numpy(), contract, 1, 0)


def _move_one(
    d: TransferPeer, d_out: DecodeOutbox, d_view: RankView, p: Prefill, port: int, n: int
) -> None:
    """One 2-page room P -> D through ``port``'s P instance, checked byte-exact."""
    p_peer, p_out, p_view = p
    rid, room = RequestId(f"ok-{n}"), Room(500 + n)
    fill_identity(p_view, {"full_attention": np.array([3, 4])}, salt=room)
    info = BootstrapInfo("127.0.0.1", port, room)
    d.register(rid, info)
    p_peer.register(rid, info)
    assert _events(d) == [Bootstrapped(rid)]
    m = build_manifest(d_view.contract, {"full_attention": np.array([7, 8])}, 0, 8)
    d_out.stage_remote_prefill([RemotePrefillRow(rid, m)])
    d_out.hand_over_remote_prefill()
    assert _events(p_peer) == [Bootstrapped(rid)]
    p_out.stage_remote_decode([RemoteDecodeRow(rid, np.array([3, 4]), 0, 8)])
    p_out.hand_over_remote_decode({rid: FirstToken(11)})
    assert _events(p_peer) == [Succeeded(rid)]
    assert _events(d) == [RemotePrefill(rid, 11)]
    assert check_identity(d_view, "full_attention", np.arange(2), np.array([7, 8]), room) == []


@pytest.mark.multiproc
def test_server_down_at_start_then_up() -> None:
    with _held_port() as port, LoopbackCluster([], [SPEC], tunables=FAST) as c:
        d, d_out, d_view = c.d[0].peer, c.d[0].outbox, c.d[0].view
        assert isinstance(d_out, DecodeOutbox)
        rid = RequestId("early")
        d.register(rid, BootstrapInfo("127.0.0.1", port, Room(1)))
        [e] = _events(d)
        assert isinstance(e, Failed)
        assert e.reason.startswith(f"bootstrap 127.0.0.1:{port}:")
        assert e.cause == "lookup"
        with BootstrapServer("127.0.0.1", port, layout_canonicalizer=_canonical):
            p = _prefill(f"127.0.0.1:{port}")
            try:
                _move_one(d, d_out, d_view, p, port, 1)
            finally:
                p[0].shutdown()
        assert d.metrics().value("tspd_pd_bootstrap_lookups_total", result="failed") == 1.0


@pytest.mark.multiproc
@pytest.mark.slow
def test_server_down_mid_run_fails_rooms_within_the_heartbeat_bound() -> None:
    with LoopbackCluster([SPEC], [SPEC], tunables=FAST) as c:
        port = c.server.port
        p, d = c.p[0].peer, c.d[0].peer
        assert isinstance(c.d[0].outbox, DecodeOutbox)
        pool = BlockPool(64)
        rid, room = RequestId("stranded"), Room(77)
        info = BootstrapInfo("127.0.0.1", port, room)
        d.register(rid, info)
        p.register(rid, info)
        assert _events(d) == [Bootstrapped(rid)]
        pages = pool.allocate(2).astype(np.int64)
        m = build_manifest(c.d[0].view.contract, {"full_attention": pages}, 0, 8)
        c.d[0].outbox.stage_remote_prefill([RemotePrefillRow(rid, m)])
        c.d[0].outbox.hand_over_remote_prefill()
        assert _events(p) == [Bootstrapped(rid)]  # P holds the prefill: D waits for input
        assert d.counters()["registrations"] == 1
        c.server.close()
        stopped = time.monotonic()
        with _held_port(port):  # the address stays ours until the new server binds it too
            [e] = _events(d, timeout_s=BOUND_S + 5)
            took = time.monotonic() - stopped
            assert isinstance(e, Failed)
            assert e.cause == "heartbeat"
            assert e.reason.startswith(f"P instance at 127.0.0.1:{port} presumed dead")
            assert took <= BOUND_S, took
            pool.decref(pages)
            assert pool.free_count() == 64
            snap = d.metrics()
            assert snap.value("tspd_pd_heartbeat_node_failures_total") == 1.0
            assert snap.value("tspd_pd_heartbeat_probes_total", result="failed") == 1.0
            assert d.counters()["registrations"] == 0  # dropped with the routes
            p.abort(rid, "the decode side gave up")
            assert _events(p) == [Failed(rid, "the decode side gave up")]
            # A new P instance behind a new server at the same address: D looks it up afresh.
            with BootstrapServer("127.0.0.1", port, layout_canonicalizer=_canonical):
                fresh = _prefill(f"127.0.0.1:{port}")
                try:
                    _move_one(d, c.d[0].outbox, c.d[0].view, fresh, port, 2)
                finally:
                    fresh[0].shutdown()
        assert not d.has_in_flight()
        assert not p.has_in_flight()
