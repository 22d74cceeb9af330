"""The Mooncake engine wrapper over real TCP: batching, windows, exact bytes, typed failures."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from tspd_core.pd.errors import ConfigError, TransferError, UsageError
from tspd_core.pd.transfer import write_stream
from tspd_core.pd.transfer.mooncake import MooncakeEngine, quiet_mooncake_logs

quiet_mooncake_logs(debug=False)


@pytest.fixture(scope="module", params=["window", "sync"])
def pair(request: pytest.FixtureRequest) -> object:
    """A writer (a 4-descriptor window, or synchronous batches of 64) and a target engine."""
    window = 4 if request.param == "window" else 0
    src = MooncakeEngine("127.0.0.1", max_batch=64, window=window)
    dst = MooncakeEngine("127.0.0.1")
    a = torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8)
    b = torch.zeros(4 << 20, dtype=torch.uint8)
    src.register(a.data_ptr(), a.numel())
    dst.register(b.data_ptr(), b.numel())
    yield src, dst, a, b
    src.close()
    dst.close()


def test_a_tcp_engine_defaults_to_a_window_of_64_and_window_0_selects_batches() -> None:
    # Only TCP engines here: the RDMA protocol (its default of synchronous batches of 4096)
    # needs an RDMA device and is never built in these tests (docs/pd.md, "Tests").
    tcp = MooncakeEngine("127.0.0.1")
    assert (tcp.window, tcp.max_batch) == (64, 512)
    assert MooncakeEngine("127.0.0.1", window=0, max_batch=7).window == 0
    tcp.close()


def test_write_many_descriptors_in_batches_byte_exact(pair: tuple) -> None:  # type: ignore[type-arg]
    src, dst, a, b = pair
    b.zero_()
    n, length = 300, 1000  # 300 descriptors -> 5 batches of <= 64
    src_off = np.arange(n, dtype=np.uint64) * 3000
    dst_off = (np.arange(n, dtype=np.uint64)[::-1] * 1000).copy()
    src.write(
        dst.session_id,
        src_off + np.uint64(a.data_ptr()),
        dst_off + np.uint64(b.data_ptr()),
        np.full(n, length, dtype=np.uint64),
    )
    expect = torch.zeros_like(b)
    for s, d in zip(src_off.tolist(), dst_off.tolist(), strict=True):
        expect[d : d + length] = a[s : s + length]
    assert torch.equal(b, expect)
    assert src.session_id == f"127.0.0.1:{src.rpc_port}"


def test_write_outside_remote_registration_is_a_transfer_error(pair: tuple) -> None:  # type: ignore[type-arg]
    src, dst, a, b = pair
    far = np.array([b.data_ptr() + b.numel() - 10], dtype=np.uint64)
    with pytest.raises(TransferError, match=r"failed \(rc -1\) on descriptors 0\.\.0 of 1"):
        src.write(
            dst.session_id, np.array([a.data_ptr()], np.uint64), far, np.array([100], np.uint64)
        )


def test_write_to_unknown_session_is_a_transfer_error(pair: tuple) -> None:  # type: ignore[type-arg]
    src, _, a, _ = pair
    ptr = np.array([a.data_ptr()], np.uint64)
    with pytest.raises(TransferError, match=r"127\.0\.0\.1:1 failed"):
        src.write("127.0.0.1:1", ptr, ptr, np.array([8], np.uint64))


def test_bad_configuration_is_rejected() -> None:
    with pytest.raises(ConfigError, match="protocol must be one of"):
        MooncakeEngine("127.0.0.1", protocol="udp")
    with pytest.raises(ConfigError, match="max_batch"):
        MooncakeEngine("127.0.0.1", max_batch=-1)
    with pytest.raises(ConfigError, match="window must be >= 0"):
        MooncakeEngine("127.0.0.1", window=-1)


class _CancelAfter(threading.Event):
    """A cancel flag that turns set after ``checks`` looks (a test double: it makes the point
    where another thread cancels exact)."""

    def __init__(self, checks: int) -> None:
        super().__init__()
        self.left = checks

    def is_set(self) -> bool:
        self.left -= 1
        return self.left < 0


def test_cancel_stops_before_the_next_descriptor_and_drains(pair: tuple) -> None:  # type: ignore[type-arg]
    src, dst, a, b = pair
    b.zero_()
    n, length = 200, 4096
    offsets = np.arange(n, dtype=np.uint64) * np.uint64(length)
    # The flag is looked at before each descriptor (windowed) or each batch of 64 (batched).
    done = 3 if src.window else 2 * 64
    with pytest.raises(TransferError, match=f"cancelled after {done} of 200 descriptors"):
        src.write(
            dst.session_id,
            offsets + np.uint64(a.data_ptr()),
            offsets + np.uint64(b.data_ptr()),
            np.full(n, length, dtype=np.uint64),
            _CancelAfter(3 if src.window else 2),
        )
    snapshot = b.clone()
    time.sleep(0.05)
    assert torch.equal(b, snapshot)  # nothing was left in flight
    assert torch.equal(b[: done * length], a[: done * length])
    assert not b[done * length : n * length].any()


# Windowed writes only: the synchronous batch call fails or lands its batch as a whole.
@pytest.mark.parametrize("pair", ["window"], indirect=True)
def test_a_failed_descriptor_drains_the_window_before_raising(pair: tuple) -> None:  # type: ignore[type-arg]
    src, dst, a, b = pair
    assert src.window
    b.zero_()
    n, length = 12, 4096
    offsets = np.arange(n, dtype=np.uint64) * np.uint64(length)
    dsts = offsets + np.uint64(b.data_ptr())
    dsts[5] = np.uint64(b.data_ptr() + b.numel() - 10)  # outside D's registration
    with pytest.raises(TransferError, match=r"failed \(rc -1\) on descriptors 5\.\.5 of 12"):
        src.write(
            dst.session_id,
            offsets + np.uint64(a.data_ptr()),
            dsts,
            np.full(n, length, dtype=np.uint64),
        )
    # Submission stops at the failure; what was already in flight (at most the window of 4:
    # descriptors 6-8) finished before the call returned, so nothing lands afterwards.
    snapshot = b.clone()
    time.sleep(0.05)
    assert torch.equal(b, snapshot)
    assert torch.equal(b[: 5 * length], a[: 5 * length])
    assert not b[9 * length : n * length].any()


def test_the_window_is_bounded_by_bytes_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(write_stream, "WINDOW_BYTES", 3 << 20)
    src, dst = MooncakeEngine("127.0.0.1", window=64), MooncakeEngine("127.0.0.1")
    a = torch.randint(
        0, 256, (12 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)
    )
    b = torch.zeros(12 << 20, dtype=torch.uint8)
    src.register(a.data_ptr(), a.numel())
    dst.register(b.data_ptr(), b.numel())
    seen: list[int] = []
    real = src._engine
    submit = src._engine.transfer_submit_write
    check = src._engine.transfer_check_status
    live: set[int] = set()

    class Spy:  # records how many descriptors were in flight at each submission
        def transfer_submit_write(self, *args: object) -> int:
            batch = int(submit(*args))
            live.add(batch)
            seen.append(len(live))
            return batch

        def transfer_check_status(self, batch: int) -> int:
            rc = int(check(batch))
            if rc != 0:
                live.discard(batch)
            return rc

    src._engine = Spy()
    starts = np.arange(12, dtype=np.uint64) << np.uint64(20)
    src.write(
        dst.session_id,
        starts + np.uint64(a.data_ptr()),
        starts + np.uint64(b.data_ptr()),
        np.full(12, 1 << 20, dtype=np.uint64),
    )
    assert torch.equal(a, b)
    assert len(seen) == 12
    assert max(seen) == 3  # 3 MiB in flight at most, 1 MiB each
    src._engine = real
    src.close()
    dst.close()


def test_unregister_stops_remote_writes_into_the_region(pair: tuple) -> None:  # type: ignore[type-arg]
    src, dst, a, _ = pair
    c = torch.zeros(1 << 16, dtype=torch.uint8)
    dst.register(c.data_ptr(), c.numel())
    assert dst.is_registered(c.data_ptr())
    ptr = np.array([a.data_ptr()], np.uint64)
    there = np.array([c.data_ptr() + 64], np.uint64)
    src.write(dst.session_id, ptr, there, np.array([32], np.uint64))
    assert torch.equal(c[64:96], a[:32])
    dst.unregister(c.data_ptr())
    assert not dst.is_registered(c.data_ptr())
    with pytest.raises(TransferError, match=r"failed \(rc -1\)"):
        src.write(dst.session_id, ptr, there, np.array([32], np.uint64))
    with pytest.raises(UsageError, match="is not registered with this engine"):
        dst.unregister(c.data_ptr())


def test_stream_pushes_complete_in_order_each_after_its_bytes_landed(pair: tuple) -> None:  # type: ignore[type-arg]
    src, dst, a, b = pair
    b.zero_()
    stream = src.stream(dst.session_id)
    seen: list[tuple[int, bool]] = []
    length = 1 << 16
    for k in range(5):  # five pushes of 3 descriptors each, sharing one window
        off = np.arange(3 * k, 3 * k + 3, dtype=np.uint64) * np.uint64(length)
        lo, hi = 3 * k * length, (3 * k + 3) * length

        def landed(k: int = k, lo: int = lo, hi: int = hi) -> None:
            seen.append((k, torch.equal(b[lo:hi], a[lo:hi])))

        stream.push(
            off + np.uint64(a.data_ptr()),
            off + np.uint64(b.data_ptr()),
            np.full(3, length, dtype=np.uint64),
            landed,
        )
    stream.finish()
    assert seen == [(k, True) for k in range(5)]
    assert stream.submitted == stream.pushed == 15
    assert stream.in_flight == 0


def test_a_failing_callback_fails_the_stream_after_draining_it(pair: tuple) -> None:  # type: ignore[type-arg]
    src, dst, a, b = pair
    stream = src.stream(dst.session_id)
    ptr = np.array([a.data_ptr()], np.uint64)
    there = np.array([b.data_ptr()], np.uint64)

    def boom() -> None:
        raise RuntimeError("callback broke")

    def two_pushes() -> None:  # windowed: the callback runs in finish(); batched: in push()
        stream.push(ptr, there, np.array([64], np.uint64), boom)
        stream.push(ptr, there + np.uint64(64), np.array([64], np.uint64))
        stream.finish()

    with pytest.raises(RuntimeError, match="callback broke"):
        two_pushes()
    assert stream.in_flight == 0
    with pytest.raises(TransferError, match="a completion callback failed"):
        stream.push(ptr, there, np.array([64], np.uint64))
