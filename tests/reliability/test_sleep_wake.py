"""Sleep and wake of the transfer peers, with real peers and a real Mooncake engine as a probe.

P: releasing the cache registration is refused while a tracked request's KV may still go out
(a room only D pre-allocated does not hold it); while asleep no request is taken; after the
wake rooms move byte-exact again. D: a write into the released arena is refused by Mooncake;
the wake comes under a fresh session, the P rank retires the old one on D's next
registration, the old session takes no write any more, and rooms move byte-exact.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tspd_core.ids import RequestId, Room
from tspd_core.layout import ArenaSpec, build_manifest
from tspd_core.pd import (
    BootstrapInfo,
    Bootstrapped,
    DecodeOutbox,
    Failed,
    FirstToken,
    PdTunables,
    PrefillOutbox,
    PrefillPeer,
    RemoteDecodeRow,
    RemotePrefill,
    RemotePrefillRow,
    Succeeded,
    TransferError,
    UsageError,
)
from tspd_core.pd.transfer.mooncake import MooncakeEngine, quiet_mooncake_logs
from tspd_testing.identity import check_identity, fill_identity
from tspd_testing.loopback import LoopbackCluster
from tspd_testing.loopback import poll_events as _events

quiet_mooncake_logs(debug=False)
SPEC = ArenaSpec(layers=2, kv_heads=4, head_dim=8, page_size=4, num_pages=64)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LoopbackCluster]:
    with LoopbackCluster([SPEC], [SPEC], tunables=PdTunables(bootstrap_timeout_s=30)) as c:
        yield c


def _outboxes(c: LoopbackCluster) -> tuple[PrefillOutbox, DecodeOutbox]:
    p_out, d_out = c.p[0].outbox, c.d[0].outbox
    assert isinstance(p_out, PrefillOutbox)
    assert isinstance(d_out, DecodeOutbox)
    return p_out, d_out


def _publish(c: LoopbackCluster, rid: RequestId, pages: list[int]) -> None:
    _, d_out = _outboxes(c)
    assert _events(c.d[0].peer) == [Bootstrapped(rid)]
    m = build_manifest(c.d[0].view.contract, {"full_attention": np.array(pages)}, 0, 8)
    d_out.stage_remote_prefill([RemotePrefillRow(rid, m)])
    d_out.hand_over_remote_prefill()


def _unclaimed(p: PrefillPeer) -> float:
    """Rooms P's worker holds that no request of its engine claimed (D's pre-allocations)."""
    return p.metrics().value("tspd_pd_rooms", state="bootstrapping")


def _move(c: LoopbackCluster, n: int) -> None:
    """One 2-page room, checked byte-exact on D."""
    p_out, _ = _outboxes(c)
    p, d = c.p[0].peer, c.d[0].peer
    rid, room = RequestId(f"move-{n}"), Room(9000 + n)
    fill_identity(c.p[0].view, {"full_attention": np.array([5, 6])}, salt=room)
    d.register(rid, BootstrapInfo(*c.bootstrap, room))
    p.register(rid, BootstrapInfo(*c.bootstrap, room))
    _publish(c, rid, [10 + n, 20 + n])
    assert _events(p) == [Bootstrapped(rid)]
    p_out.stage_remote_decode([RemoteDecodeRow(rid, np.array([5, 6]), 0, 8)])
    p_out.hand_over_remote_decode({rid: FirstToken(3)})
    assert _events(p) == [Succeeded(rid)]
    assert _events(d) == [RemotePrefill(rid, 3)]
    dst = np.array([10 + n, 20 + n])
    assert check_identity(c.d[0].view, "full_attention", np.arange(2), dst, room) == []


@pytest.mark.multiproc
def test_p_sleep_is_refused_while_kv_may_go_out_then_wakes(cluster: LoopbackCluster) -> None:
    p_out, _ = _outboxes(cluster)
    p, d = cluster.p[0].peer, cluster.d[0].peer
    assert isinstance(p, PrefillPeer)
    busy = RequestId("busy")
    p.register(busy, BootstrapInfo(*cluster.bootstrap, Room(1)))
    with pytest.raises(UsageError, match=r"1 tracked request\(s\) may still move KV \(busy\)"):
        p_out.release_registration()
    p.abort(busy, "done with it")
    assert _events(p) == [Failed(busy, "done with it")]
    # A room only D pre-allocated (no request claimed it on P) does not hold the sleep.
    orphan = RequestId("orphan")
    unclaimed = _unclaimed(p)
    d.register(orphan, BootstrapInfo(*cluster.bootstrap, Room(2)))
    _publish(cluster, orphan, [30, 31])
    deadline = time.monotonic() + 20
    while _unclaimed(p) == unclaimed:  # the pre-allocation reached P's worker
        assert time.monotonic() < deadline, "P never got D's pre-allocation"
        time.sleep(0.01)
    p_out.release_registration()
    assert p.metrics().value("tspd_pd_asleep") == 1.0
    with pytest.raises(UsageError, match="asleep"):
        p.register(RequestId("while-asleep"), BootstrapInfo(*cluster.bootstrap, Room(3)))
    with pytest.raises(UsageError, match="already released"):
        p_out.release_registration()
    p.abort_room(Room(2), "P is asleep")
    assert _events(d) == [Failed(orphan, "P rank 0 aborted the transfer")]
    p_out.restore_registration()
    assert p.metrics().value("tspd_pd_asleep") == 0.0
    with pytest.raises(UsageError, match="is not released"):
        p_out.restore_registration()
    _move(cluster, 1)


@pytest.mark.multiproc
def test_d_wakes_under_a_fresh_session_that_p_picks_up(cluster: LoopbackCluster) -> None:
    _, d_out = _outboxes(cluster)
    d = cluster.d[0].peer
    _move(cluster, 2)  # D is registered with the P rank under its first session
    old = d.session_id()
    probe = MooncakeEngine("127.0.0.1")
    src = torch.arange(64, dtype=torch.uint8)
    probe.register(src.data_ptr(), 64)
    ready = d._worker.ready
    assert ready is not None
    base = ready.base_ptr  # the arena as the D worker maps it (Mooncake writes land there)

    def write(session: str) -> None:
        ptr = np.array([src.data_ptr()], np.uint64)
        probe.write(session, ptr, np.array([base + 4096], np.uint64), np.array([64], np.uint64))

    # D's arena as this process maps it; the target bytes hold a sentinel before each write,
    # so only a write that landed can put the probe's bytes there.
    target = cluster.d[0].view.arena[4096 : 4096 + 64]
    sentinel = (255 - np.arange(64)).astype(np.uint8)

    def landed(session: str) -> bool:
        target[:] = sentinel
        write(session)
        return bool(target.tolist() == list(range(64)))

    def refused(session: str) -> bool:
        target[:] = sentinel
        why = f"Mooncake write to {session} failed (rc -1) on descriptors 0..0 of 1 (64 bytes)"
        with pytest.raises(TransferError, match=f"^{re.escape(why)}$"):
            write(session)
        return bool(target.tolist() == sentinel.tolist())

    try:
        assert landed(old)  # registered: lands
        busy = RequestId("busy-d")
        d.register(busy, BootstrapInfo(*cluster.bootstrap, Room(4)))
        with pytest.raises(UsageError, match=r"may still move KV \(busy-d\)"):
            d_out.release_registration()
        d.abort(busy, "done with it")
        # The cached look-up may bootstrap it before the abort lands: then that comes first.
        got = _events(d, want=1)
        got += _events(d) if got == [Bootstrapped(busy)] else []
        assert got[-1] == Failed(busy, "done with it")
        d_out.release_registration()
        assert refused(old)  # the arena is deregistered: Mooncake refuses the write
        d_out.restore_registration()
        assert d.session_id() != old
        assert landed(d.session_id())
        assert refused(old)  # the old session is gone for good
    finally:
        probe.close()
    _move(cluster, 3)  # the P rank learns the new session from D's new registration
    snap = cluster.p[0].peer.metrics()
    assert snap.value("tspd_pd_d_sessions") == 1.0  # the old session was retired
