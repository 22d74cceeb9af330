"""The Mooncake engine wrapper over real TCP: batching, exact bytes, typed failures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tspd_core.pd.engine import MooncakeEngine, quiet_mooncake_logs
from tspd_core.pd.errors import ConfigError, TransferError, UsageError

quiet_mooncake_logs(debug=False)


@pytest.fixture(scope="module")
def pair() -> object:
    src, dst = MooncakeEngine("127.0.0.1", max_batch=64), MooncakeEngine("127.0.0.1")
    a = torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8)
    b = torch.zeros(4 << 20, dtype=torch.uint8)
    src.register(a.data_ptr(), a.numel())
    dst.register(b.data_ptr(), b.numel())
    yield src, dst, a, b
    src.close()
    dst.close()


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
