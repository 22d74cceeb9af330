"""PD on one device, byte-exact: real bootstrap server, transfer workers, ZMQ and Mooncake, with
every arena on the device under test (on CUDA: GPU memory the workers map through CUDA IPC and
Mooncake reads and writes as GPU memory; D zeroes new pages on the device and publishes a
manifest only once that zeroing's event completed).

* One P rank and one D rank (each with its transfer worker process, the arenas on the same
  device) move identity-tagged rooms concurrently; every destination page holds its room's
  identity, every other byte of D is unchanged, P sent exactly the pages D lacked. (Separate
  P and D engine processes on one device: ``test_pd_engine_device.py``.)
* P TP 2 -> D TP 1 with every job staged: P gathers and D scatters on the device
  (``byterows``' index kernels and their stream synchronisation).
* Layerwise, 1P1D: a simulated forward writes each layer's KV (pushed to the device) and then
  advances a step counter on the device; no interval may leave before its layers landed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tspd_core.layout import ArenaSpec, PageLayout
from tspd_core.pd import PdTunables
from tspd_core.pd.events import RemotePrefill, Succeeded
from tspd_testing.layerwise_loopback import SimulatedForward, chunked_jobs, drive_layerwise
from tspd_testing.loopback import LoopbackCluster, plan_rooms

from .conftest import DEVICES

pytestmark = pytest.mark.multiproc

PAGE = 4
SPEC = ArenaSpec(layers=2, kv_heads=2, head_dim=16, page_size=PAGE, num_pages=160)


def _spec(tp: int, rank: int, layers: int = 2) -> ArenaSpec:
    return ArenaSpec(layers=layers, kv_heads=4, head_dim=8, page_size=PAGE, tp_size=tp,
                     tp_rank=rank, page_layout=PageLayout.HND, num_pages=240)  # fmt: skip


LAYERS = 4


@pytest.fixture(scope="module", params=DEVICES)
def one_to_one(request: pytest.FixtureRequest) -> Iterator[LoopbackCluster]:
    """One P rank (streaming layerwise when armed, else handing over after the forward) and
    one D rank, their arenas on the device under test; a counter that wraps mid-module."""
    spec = _spec(1, 0, LAYERS)
    with LoopbackCluster([spec], [spec], layerwise_interval=1, counter_start=(1 << 62) - 5,
                         device=request.param) as cluster:  # fmt: skip
        yield cluster


def test_one_p_rank_and_one_d_rank_on_one_device_move_rooms_byte_exact(
    one_to_one: LoopbackCluster,
) -> None:
    cluster = one_to_one
    before = cluster.p[0].peer.metrics().value("tspd_pd_transfer_bytes_total")
    # 12 concurrent rooms of 1-40 tokens, fragmented tables, some with D prefix hits; P hands
    # each over after its (whole) forward.
    rooms = plan_rooms(cluster.p[0].view.contract, cluster.d[0].view.contract, 12, 40, seed=11)
    assert any(r.prefix_len for r in rooms)
    snapshots = cluster.tag(rooms, seed=4)
    outcome = cluster.drive(rooms, timeout_s=120)
    assert outcome.final("d", 0) == {r.rid: RemotePrefill(r.rid, r.token) for r in rooms}
    assert outcome.final("p", 0) == {r.rid: Succeeded(r.rid) for r in rooms}
    assert cluster.verify(rooms, snapshots) == []
    page = sum(f.payload_bytes for f in cluster.p[0].view.contract.plan.fields)
    pages = sum(-(-r.prompt_len // PAGE) - r.prefix_len // PAGE for r in rooms)
    sent = cluster.p[0].peer.metrics().value("tspd_pd_transfer_bytes_total") - before
    assert sent == pages * page


@pytest.mark.parametrize("device", DEVICES)
def test_staged_re_slicing_gathers_and_scatters_on_the_device(device: str) -> None:
    # stage_min_runs=1: every job with runs to cut is staged (gather on P, scatter on D).
    tun = PdTunables(stage_min_runs=1)
    p_specs, d_specs = [_spec(2, 0), _spec(2, 1)], [_spec(1, 0)]
    with LoopbackCluster(p_specs, d_specs, tunables=tun, device=device) as cluster:
        assert cluster.p[0].arena.device.type == device
        rooms = plan_rooms(cluster.p[0].view.contract, cluster.d[0].view.contract, 10, 30, seed=3)
        snapshots = cluster.tag(rooms, seed=1)
        outcome = cluster.drive(rooms, timeout_s=120)
        assert outcome.final("d", 0) == {r.rid: RemotePrefill(r.rid, r.token) for r in rooms}
        for i in (0, 1):
            assert outcome.final("p", i) == {r.rid: Succeeded(r.rid) for r in rooms}
        assert cluster.verify(rooms, snapshots) == []
        staged = [rank.peer.counters()["staged_jobs"] for rank in cluster.p]
        assert all(n > 0 for n in staged), staged


def test_layerwise_intervals_leave_only_after_their_layers_reached_the_device(
    one_to_one: LoopbackCluster,
) -> None:
    cluster, layers = one_to_one, LAYERS
    counter = cluster.p[0].outbox.step_counter  # type: ignore[union-attr]
    assert counter.device == cluster.device
    before = cluster.p[0].peer.metrics()
    rooms = plan_rooms(cluster.p[0].view.contract, cluster.d[0].view.contract, 8, 30, seed=5)
    snapshots = cluster.tag(rooms, seed=2)
    # Each step "computes" 5 ms before its KV lands: a send ahead of the counter would
    # find P's pages still zero.
    forward = SimulatedForward(cluster, compute_s=0.005)
    jobs = chunked_jobs(rooms, PAGE, chunk=8, seed=layers)
    forward.prefill_cached(jobs)
    outcome = drive_layerwise(forward, jobs, timeout_s=120)
    assert outcome.final("d", 0) == {r.rid: RemotePrefill(r.rid, r.token) for r in rooms}
    assert outcome.final("p", 0) == {r.rid: Succeeded(r.rid) for r in rooms}
    assert cluster.verify(rooms, snapshots) == []
    # Every armed chunk went out one interval (one layer) at a time.
    after = cluster.p[0].peer.metrics()
    armed, intervals = (
        after.value(name) - before.value(name)
        for name in ("tspd_pd_layerwise_chunks_total", "tspd_pd_layerwise_intervals_total")
    )
    assert armed >= len(rooms)
    assert intervals == armed * layers
