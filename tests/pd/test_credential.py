"""The cluster credential with real peers, and D looking P ranks up again after a failed room.

One sealed cluster (bootstrap server, P TP 2, D TP 1, all with the credential): rooms move
byte-exact; registrations and staging offers that are unsealed, sealed with another secret,
altered after sealing or replayed are dropped by the P rank (counted by reason) and the real
D session is unharmed; a room that fails makes D drop the P ranks' cached addresses, so the
next room looks them up again (and still moves byte-exact); a D rank without the credential,
or one that disagrees with its P instance about it, fails its room with the reason.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import requests
import torch
import zmq

from tspd_bootstrap import BootstrapServer, ClusterCredential
from tspd_core.ids import RequestId, Room
from tspd_core.layout import (
    ArenaSpec,
    build_contract,
    build_manifest,
    canonical_layout_text,
    encode_contract,
)
from tspd_core.pd import (
    BootstrapInfo,
    Bootstrapped,
    DecodeOutbox,
    DecodePeer,
    DecodePeerConfig,
    Failed,
    PdTunables,
    RemotePrefill,
    RemotePrefillRow,
)
from tspd_core.pd.wire.frames import (
    Registration,
    StageOffer,
    encode_registration,
    encode_stage_offer,
    seal_frames,
)
from tspd_testing.loopback import LoopbackCluster, plan_rooms
from tspd_testing.loopback import poll_events as _events

pytestmark = pytest.mark.multiproc

CRED = ClusterCredential.from_text("tests/pd's cluster token: 0123456789")
OTHER = ClusterCredential.from_text("somebody else's token, 0123456789")
P_SPECS = [
    ArenaSpec(layers=2, kv_heads=4, head_dim=8, page_size=4, num_pages=64, tp_size=2, tp_rank=r)
    for r in range(2)
]
D_SPEC = ArenaSpec(layers=2, kv_heads=4, head_dim=8, page_size=4, num_pages=64)
# D gives up on a room with no P side after 1 s; small pages go through D's staging slots.
TUNABLES = PdTunables(waiting_timeout_s=1.0, bootstrap_timeout_s=3.0, stage_min_runs=1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LoopbackCluster]:
    with LoopbackCluster(P_SPECS, [D_SPEC], tunables=TUNABLES, credential=CRED) as c:
        yield c


def _move(cluster: LoopbackCluster, count: int, seed: int) -> None:
    """``count`` rooms P -> D, byte-exact."""
    planned = plan_rooms(cluster.p[0].view.contract, cluster.d[0].view.contract, count, 20, seed)
    rooms = [dataclasses.replace(r, rid=RequestId(f"s{seed}-{r.rid}")) for r in planned]
    snapshots = cluster.tag(rooms, seed=seed)
    outcome = cluster.drive(rooms)
    assert outcome.final("d", 0) == {r.rid: RemotePrefill(r.rid, r.token) for r in rooms}
    assert cluster.verify(rooms, snapshots) == []


def _wait(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _server_metric(cluster: LoopbackCluster, sample: str) -> float:
    text = requests.get(cluster.server.url + "/metrics", timeout=5).text  # open: no seal
    return float(next(x for x in text.splitlines() if x.startswith(sample + " ")).split()[-1])


def test_a_sealed_cluster_moves_rooms_byte_exact(cluster: LoopbackCluster) -> None:
    _move(cluster, 6, seed=1)
    for rank in cluster.p:
        assert rank.peer.metrics().total("tspd_pd_refused_seals_total") == 0
        assert rank.peer.counters()["staging_grants"] == 1  # D's sealed offer was taken
    for entry in cluster.server.snapshot().ranks:  # what D saw in its (sealed) look-ups
        assert entry.extensions == ("tspd.auth/1", "tspd.lease/1", "tspd.stage/2")
    unsealed = requests.get(cluster.server.url + "/route?engine_rank=0&target_dp_group=0")
    assert (unsealed.status_code, unsealed.json()["error"]) == (401, "unauthenticated")


def test_forged_registrations_and_offers_are_dropped_unharmed(cluster: LoopbackCluster) -> None:
    _move(cluster, 2, seed=2)  # D's session is registered with both P ranks
    p0 = cluster.p[0].peer
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{p0.port()}")
    real = cluster.d[0].peer.session_id()
    contract = encode_contract(cluster.d[0].view.contract)
    # The real session at another arena address: accepted, it would reject the real one.
    hijack = encode_registration(Registration("127.0.0.1", port, real, 1 << 40, contract, 1, 0))
    fake = encode_registration(Registration("127.0.0.1", port, "127.0.0.1:1", 8, contract, 1, 0))
    offer = encode_stage_offer(StageOffer(real, 0, 1 << 40, 8 << 20, 2, ordered=True))
    genuine = seal_frames(fake, CRED)
    sent = [
        hijack,  # unsealed
        seal_frames(hijack, OTHER),  # another secret
        [*hijack[:4], struct.pack("<Q", 1 << 41), *hijack[5:], seal_frames(hijack, CRED)[8]],
        seal_frames(offer, OTHER),
        genuine,  # a new session, sealed: accepted
        genuine,  # ... once
    ]
    for frames in sent:
        push.send_multipart(frames)
    want = {
        ("registration", "unsealed"): 1,
        ("registration", "bad_seal"): 2,
        ("stage_offer", "bad_seal"): 1,
        ("registration", "replayed_seal"): 1,
    }

    def refused() -> dict[tuple[str, str], float]:
        snap = p0.metrics()
        name = "tspd_pd_refused_seals_total"
        return {k: snap.value(name, message=k[0], reason=k[1]) for k in want}

    _wait(lambda: refused() == want, f"P rank 0 to refuse {want}")
    assert p0.counters()["sessions"] == 2  # the real one and the genuine new one
    assert not pull.poll(200)  # nothing was pushed to the forger: no session was rejected
    _move(cluster, 3, seed=3)  # the real session moves rooms as before
    pull.close(linger=0)
    push.close(linger=0)


def test_a_failed_room_makes_d_look_its_p_ranks_up_again(cluster: LoopbackCluster) -> None:
    _move(cluster, 1, seed=4)  # the P ranks' addresses are cached
    d = cluster.d[0]
    drops = d.peer.metrics().value("tspd_pd_endpoint_drops_total")
    hits = 'tspd_bootstrap_lookups_total{kind="rank",result="hit"}'
    looked_up = _server_metric(cluster, hits)
    rid = RequestId("no-prefill")  # a room no P rank serves: D's waiting timeout fails it
    d.peer.register(rid, BootstrapInfo(*cluster.bootstrap, Room(4242)))
    assert _events(d.peer) == [Bootstrapped(rid)]
    assert _server_metric(cluster, hits) == looked_up  # served from the cache
    manifest = build_manifest(d.view.contract, {"full_attention": np.array([9])}, 0, 3)
    assert isinstance(d.outbox, DecodeOutbox)
    d.outbox.stage_remote_prefill([RemotePrefillRow(rid, manifest)])
    assert d.outbox.hand_over_remote_prefill() == 1
    assert _events(d.peer) == [Failed(rid, "no Success from P ranks [0, 1] in 1 s")]
    assert d.peer.metrics().value("tspd_pd_endpoint_drops_total") == drops + 2
    _move(cluster, 1, seed=5)
    assert _server_metric(cluster, hits) == looked_up + 2  # both P ranks asked for again


@pytest.fixture(scope="module")
def bare_decode() -> Iterator[DecodePeer]:
    """A D rank without the credential (its own worker)."""
    contract = build_contract(D_SPEC)
    arena = torch.zeros(contract.plan.arena_bytes, dtype=torch.uint8)
    config = DecodePeerConfig(
        contract=encode_contract(contract).decode(),
        arena=arena,
        host="127.0.0.1",
        tunables=TUNABLES,
        credential=None,
    )
    peer, _ = DecodePeer.start(config)
    yield peer
    peer.shutdown()


def _lone_p_instance(server: BootstrapServer, extensions: list[str]) -> None:
    """A P instance of one rank at a port nobody serves (D fails before sending to it)."""
    body = {
        "role": "Prefill",
        "world_size": 1,
        "dp_size": 1,
        "rank_ip": "127.0.0.1",
        "rank_port": 9,
        "engine_rank": 0,
        "cache_layout": canonical_layout_text(encode_contract(build_contract(D_SPEC)).decode()),
        "tspd_extensions": extensions,
    }
    assert requests.put(server.url + "/route", data=json.dumps(body), timeout=5).status_code == 200


def test_a_decode_rank_that_disagrees_about_the_credential_fails_its_room(
    cluster: LoopbackCluster, bare_decode: DecodePeer
) -> None:
    rid = RequestId("bare")
    bare_decode.register(rid, BootstrapInfo(*cluster.bootstrap, Room(5)))
    [event] = _events(bare_decode)
    assert isinstance(event, Failed)
    assert event.cause == "lookup"
    refused = "GET /route parallel info failed: 401 unauthenticated: GET /route: this bootstrap"
    assert refused in event.reason
    with BootstrapServer("127.0.0.1", 0, layout_canonicalizer=canonical_layout_text) as plain:
        _lone_p_instance(plain, ["tspd.auth/1"])  # P says it requires the credential
        rid = RequestId("bare-sealed-p")
        bare_decode.register(rid, BootstrapInfo("127.0.0.1", plain.port, Room(6)))
        [event] = _events(bare_decode)
        assert event == Failed(
            rid,
            f"P rank 0 of 127.0.0.1:{plain.port} requires the cluster credential (it announced "
            "tspd.auth/1); start this node with --cluster-token-file (or "
            "$TSPD_CLUSTER_TOKEN_FILE)",
            "lookup",
        )
    with BootstrapServer("127.0.0.1", 0, layout_canonicalizer=canonical_layout_text) as plain:
        _lone_p_instance(plain, [])  # a P without the credential, e.g. a TokenSpeed one
        d = cluster.d[0].peer  # sealed
        rid = RequestId("sealed-d-bare-p")
        d.register(rid, BootstrapInfo("127.0.0.1", plain.port, Room(7)))
        [event] = _events(d)
        assert event == Failed(
            rid,
            f"P rank 0 of 127.0.0.1:{plain.port} does not take the cluster credential (it did "
            "not announce tspd.auth/1): with the credential on, every prefill node needs it too",
            "lookup",
        )
