"""tspd_core.feed: sources, masks, masked argmax, feed cells, host ring and events (CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tspd_core.feed import (
    HOST_BIT,
    NO_ID,
    FeedError,
    FromFeed,
    FromHost,
    HostRing,
    ModelDeviceFeed,
    TorchFeedDevice,
    encode_sources,
    masked_argmax,
    row_masks,
)

CPU = torch.device("cpu")


def test_sources_encode_feed_rows_and_host_ids() -> None:
    words = encode_sources([FromFeed(2), FromHost(7), FromFeed(0)], cells=4)
    assert words.tolist() == [2, HOST_BIT | 7, 0]
    with pytest.raises(FeedError, match="row 0: feed row 4 outside the 4 feed cells"):
        encode_sources([FromFeed(4)], cells=4)
    with pytest.raises(FeedError, match="row 1: host token -1 is not a valid id"):
        encode_sources([FromHost(1), FromHost(-1)], cells=4)


def test_row_masks_pad_with_no_id() -> None:
    assert row_masks([[], [5], [1, 2]]).tolist() == [[NO_ID, NO_ID], [5, NO_ID], [1, 2]]
    with pytest.raises(FeedError, match="at most two ids"):
        row_masks([[1, 2, 3]])


def test_masked_argmax_skips_masked_ids_and_breaks_ties_low() -> None:
    logits = torch.tensor([[4.0, 9.0, 9.0, 1.0], [4.0, 9.0, 9.0, 1.0], [0.0, 2.0, 3.0, 3.0]])
    masks = torch.tensor([[NO_ID, NO_ID], [1, 2], [2, NO_ID]])
    assert masked_argmax(logits, masks).tolist() == [1, 0, 3]


def test_feed_cells_resolve_and_ring_readback() -> None:
    dev = TorchFeedDevice(CPU, max_rows=4)
    ring = HostRing(dev, depth=2)
    slot = ring.acquire(3)
    ids = dev.argmax_to_cells(torch.eye(3, 5) * 3, row_masks([[], [1], []]))
    dev.copy_d2h_async(ids, slot.cells[:3])
    dev.record(slot.event)
    assert ring.ready(slot)
    # The next step reads row 2's and row 0's cells and one host id, without the host.
    resolved = dev.resolve(encode_sources([FromFeed(2), FromHost(99), FromFeed(0)], 4))
    assert resolved.tolist() == [2, 99, 0]
    assert ring.read(slot).tolist() == [0, 0, 2]
    assert ring.in_flight == 0


def test_ring_overrun_and_double_read_are_refused() -> None:
    ring = HostRing(TorchFeedDevice(CPU, max_rows=2), depth=2)
    first, _second = ring.acquire(1), ring.acquire(2)
    with pytest.raises(FeedError, match="host ring overrun: slot 0"):
        ring.acquire(1)
    ring.device.record(first.event)
    ring.read(first)
    with pytest.raises(FeedError, match="read twice"):
        ring.read(first)
    with pytest.raises(FeedError, match="3 rows, ring width 2"):
        ring.acquire(3)
    ring.close()
    with pytest.raises(FeedError, match="destroyed"):
        ring.device.record(first.event)


def test_unrecorded_event_is_an_error_and_pinned_alloc_is_zeroed() -> None:
    dev = TorchFeedDevice(CPU, max_rows=1)
    with pytest.raises(FeedError, match="never recorded"):
        dev.query(dev.new_event())
    buf = dev.alloc_host_pinned(16)
    assert buf.tolist() == [0] * 16
    dev.free_host_pinned(buf)
    assert buf.numel() == 0


def test_model_without_feed_says_so() -> None:
    class Plain(ModelDeviceFeed[list[int], int]):
        pass

    plain = Plain()
    assert not plain.supports_device_token_feed()
    with pytest.raises(FeedError, match="decode_batch_fed: this model has no device token feed"):
        plain.decode_batch_fed(encode_sources([FromHost(1)], 1), [0])
    assert plain.event_query(TorchFeedDevice(CPU, 1).new_event())
    assert np.array_equal(row_masks([]), np.empty((0, 2), dtype=np.int64))
