"""Model runner: turns scheduler batches into forwards over the arena, and the device feed.

:class:`ModelRunner` is the engine's :class:`~tspd_core.feed.ModelDeviceFeed`: prefill chunks
and synchronous decode rounds take their input ids from the host; a fed decode round resolves
them on the device from the feed cells the previous round's argmax wrote. Both decode paths
run the same forward, so they produce the same tokens.

Ownership: the engine thread of one rank; it reads the scheduler's rounds and never changes the
scheduler except through ``release_decode_blocks`` (a discarded step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from tspd_core.feed import IntArray, TorchFeedDevice, TorchModelFeed, masked_argmax, to_device
from tspd_core.ids import RequestId
from tspd_core.sched import RequestScheduler
from tspd_core.sched.rounds import DecodeRound
from tspd_engine.errors import EngineError
from tspd_engine.model.attention import AttnMeta, build_meta, pack_tables
from tspd_engine.model.kv_arena import KvArena
from tspd_engine.model.llama import AfterLayer, LlamaModel


@dataclass(slots=True)
class RoundShape:
    """What the forwards of one scheduler round computed: the regressors of a step-time model
    (``tspd-sim calibrate`` fits them; the rank's step log writes them)."""

    prefill_seqs: int = 0  # prefill chunks
    prefill_tokens: int = 0  # Σ n: new tokens of the chunks
    prefill_ctx: int = 0  # Σ c: tokens already cached before each chunk
    prefill_pairs: int = 0  # Σ (n·c + n(n+1)/2): causal query-key pairs
    decode_batch: int = 0  # rows of the decode step
    decode_ctx: int = 0  # Σ (position + 1): keys each row attends to

    @property
    def empty(self) -> bool:
        return not (self.prefill_seqs or self.decode_batch)


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Prompt tokens ``tokens`` of one request, written from position ``start`` on."""

    start: int
    tokens: npt.NDArray[np.int32]
    table: npt.NDArray[np.int32]  # the request's page table (covers start + len(tokens))


class ModelRunner(TorchModelFeed[DecodeRound, RequestId]):
    """Forwards for one rank; the device feed over ``max_rows`` cells."""

    def __init__(
        self, model: LlamaModel, arena: KvArena, scheduler: RequestScheduler, max_rows: int
    ) -> None:
        super().__init__(TorchFeedDevice(model.device, max_rows))
        self.model = model
        self.arena = arena
        self.scheduler = scheduler
        self.page_size = arena.page_size
        self.device = model.device
        self.forward_tokens = 0  # tokens pushed through the model (a metric for tests/bench)
        self.shape = RoundShape()  # what this round's forwards computed (see take_shape)

    def take_shape(self) -> RoundShape:
        """What the forwards since the last call computed (a round's, when called per round)."""
        shape, self.shape = self.shape, RoundShape()
        return shape

    # -- prefill --------------------------------------------------------------------------

    def prefill(
        self, chunks: list[PrefillChunk], after_layer: AfterLayer | None = None
    ) -> torch.Tensor:
        """Forward the chunks as one ragged batch; logits ``[len(chunks), vocab]`` (device).
        ``after_layer(i)`` runs after layer ``i``'s KV writes (layerwise PD streaming)."""
        context = np.array([c.start for c in chunks], dtype=np.int64)
        new = np.array([len(c.tokens) for c in chunks], dtype=np.int64)
        ids = np.concatenate([c.tokens for c in chunks]).astype(np.int64)
        tables = pack_tables([c.table for c in chunks])
        meta = build_meta(context, new, *tables, self.page_size, self.device)
        shape = self.shape
        shape.prefill_seqs += len(chunks)
        shape.prefill_tokens += int(new.sum())
        shape.prefill_ctx += int(context.sum())
        shape.prefill_pairs += int(new @ context + (new * (new + 1)).sum() // 2)
        return self._forward(to_device(ids, self.device), meta, after_layer)

    # -- decode ---------------------------------------------------------------------------

    def decode_batch(self, batch: DecodeRound) -> torch.Tensor:
        """A synchronous decode round: every input id is on the host."""
        items = batch.items
        if not items.token_on_host.all():
            raise EngineError("decode_batch: a row's input is still on the device; use the feed")
        ids = to_device(items.token.astype(np.int64), self.device)
        return self._decode(batch, ids)

    def decode_batch_fed(self, sources: IntArray, batch: DecodeRound) -> torch.Tensor:
        if len(sources) != batch.size:
            raise EngineError(f"decode_batch_fed: {len(sources)} sources for {batch.size} rows")
        ids = self.feed_device.resolve(sources)
        self.fed_in_flight += 1
        return self._decode(batch, ids)

    def _decode(self, batch: DecodeRound, ids: torch.Tensor) -> torch.Tensor:
        if len(batch.copies):  # copy-on-write before any KV of this round is written
            self.arena.copy_pages(batch.copies[:, 0], batch.copies[:, 1])
        items = batch.items
        context = items.position.astype(np.int64)
        new = np.ones(batch.size, dtype=np.int64)
        self.shape.decode_batch += batch.size
        self.shape.decode_ctx += int(context.sum()) + batch.size
        meta = build_meta(
            context,
            new,
            batch.block_table,
            items.table_offset.astype(np.int64),
            items.table_len.astype(np.int64),
            self.page_size,
            self.device,
        )
        return self._forward(ids, meta)

    def _forward(
        self, ids: torch.Tensor, meta: AttnMeta, after_layer: AfterLayer | None = None
    ) -> torch.Tensor:
        self.forward_tokens += int(ids.shape[0])
        return self.model.forward(self.model.embed(ids), meta, self.arena.pages, after_layer)

    def argmax_host(self, logits: torch.Tensor, masks: IntArray) -> IntArray:
        """The synchronous readback: masked argmax copied to the host (waits for the device)."""
        m = to_device(masks, self.device)
        return masked_argmax(logits, m).cpu().numpy().astype(np.int64)

    # -- blocks of discarded steps ---------------------------------------------------------

    def reserve_decode_block(self, row: RequestId) -> int:
        """Pages held ahead of ``row``'s committed tokens for its launched steps.

        tspd's scheduler reserves in bulk: ``prepare_decode_round`` allocates the page of
        every row's next position (or its copy-on-write copy) for the whole round, so this
        reports that reservation rather than making a second one.
        """
        view = self.scheduler.view(row)
        return view.num_pages - -(-view.num_tokens // self.page_size)

    def release_decode_blocks(self, row: RequestId, blocks: int) -> None:
        """Drop ``row``'s launched-but-uncommitted steps and the ``blocks`` pages only they
        reserved (checked), through the scheduler."""
        held = self.reserve_decode_block(row)
        if blocks != held:
            raise EngineError(f"release_decode_blocks({row!r}, {blocks}): {held} are reserved")
        self.scheduler.discard_pending(row)
