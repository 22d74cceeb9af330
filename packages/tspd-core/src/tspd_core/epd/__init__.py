"""EPD: encode-node embedding sender and prefill-node embedding receiver (wire.md §2.5).

Encode rank (engine process + transfer worker process, like PD)::

    sender = EmbeddingSender.start(EmbeddingSenderConfig(bootstrap_url=..., tp_size=E, tp_rank=e))
    sender.send(EmbeddingChunk(room, rows, deepstack_rows))   # None: send buffer full, retry
    for outcome in sender.poll(): ...                          # one SendOutcome per chunk
    sender.abort_room(room)                                    # receivers get Failed

Prefill rank (scheduler thread; every rank of the replica stages the same requests in order)::

    receiver = embedding_receiver(engine, EmbeddingReceiverConfig(hidden=..., dtype=..., tp_size=P,
                                                                  tp_rank=p), aborter=prefill_peer)
    receiver.stage(rid, [EmbeddingItem(room, host, port, n_tokens), ...], pd_room=...)
    settlement = receiver.settle(replica_group)   # collective: MIN of FAILED 0/PENDING 1/DONE 2
    for landed in settlement.admitted: ...prefill with landed.items...; receiver.release(rid)

See docs/epd.md.
"""

from tspd_core.epd.assemble import assemble
from tspd_core.epd.config import EmbeddingReceiverConfig, EmbeddingSenderConfig, shard_from_env
from tspd_core.epd.items import (
    Admission,
    EmbeddingChunk,
    EmbeddingItem,
    FailedRequest,
    LandedItem,
    LandedRequest,
    Settlement,
    ShardMode,
    shard_rows,
)
from tspd_core.epd.pool import BufferPool, Extent, PoolStats
from tspd_core.epd.receiver import (
    EmbeddingReceiver,
    ReceiverStats,
    RoomAborter,
    embedding_receiver,
    open_embedding_receiver,
    receiver_for_peer,
)
from tspd_core.epd.sender import EmbeddingSender, SendOutcome
from tspd_core.epd.tower import ToyVisionTower

__all__ = [
    "Admission",
    "BufferPool",
    "EmbeddingChunk",
    "EmbeddingItem",
    "EmbeddingReceiver",
    "EmbeddingReceiverConfig",
    "EmbeddingSender",
    "EmbeddingSenderConfig",
    "Extent",
    "FailedRequest",
    "LandedItem",
    "LandedRequest",
    "PoolStats",
    "ReceiverStats",
    "RoomAborter",
    "SendOutcome",
    "Settlement",
    "ShardMode",
    "ToyVisionTower",
    "assemble",
    "embedding_receiver",
    "open_embedding_receiver",
    "receiver_for_peer",
    "shard_from_env",
    "shard_rows",
]
