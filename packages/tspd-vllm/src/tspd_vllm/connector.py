"""``TspdConnector``: vLLM's KV connector interface (``KVConnectorBase_V1``, vLLM 0.32) over
tspd's transfer peers.

Load it into vLLM by module path::

    --kv-transfer-config '{"kv_connector": "TspdConnector",
                           "kv_connector_module_path": "tspd_vllm.connector",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"bootstrap_port": 8998}}'

vLLM builds one instance per role: the scheduler side in its scheduler process
(:mod:`tspd_vllm.scheduler`: which requests move KV) and the worker side in each worker
(:mod:`tspd_vllm.worker`: the moving, by tspd's PrefillPeer/DecodePeer over Mooncake, the
rendezvous by tspd's bootstrap server, the copies planned by tspd's layout planner from a
cache contract of vLLM's own KV tensors, :mod:`tspd_vllm.arena`). This module only adapts
vLLM's objects to those two; each instance is called on one vLLM thread.

What vLLM calls and what it does here (P = ``kv_producer``, D = ``kv_consumer``):

* ``get_num_new_matched_tokens`` (D): the prompt past D's prefix hit, loaded asynchronously;
  (P): a request naming ``abort_room`` (the front's) fails that room in this step.
* ``update_state_after_alloc`` (D): the receive, with D's blocks.
* ``request_finished`` (P): hold the blocks, answer the rendezvous in ``kv_transfer_params``.
* ``build_connector_meta``: the step's sends and receives, to every worker.
* ``register_kv_caches``: the arena and contract of this rank's KV views; the peer starts.
* ``start_load_kv``: hand the step's jobs to the peer, unless P took them already (nothing
  blocks on the forward: transfers run in tspd's transfer worker process).
* ``get_transfer_results``: poll the peer (a collective across the TP group): sends and
  receives that ended, receives that failed (vLLM fails or recomputes those by its
  ``kv_load_failure_policy``).
* ``wait_for_layer_load`` (P): the step's jobs are taken in its first call, before the
  forward — vLLM calls ``start_load_kv`` after the forward when loads are asynchronous, so a
  send taken there would wait a whole forward. D: nothing.
* ``save_kv_layer`` / ``wait_for_save``: nothing by default — P's KV goes out once the
  prefill finished (the whole prompt at once, the first token with it). With
  ``layerwise_interval`` > 0 (P), each ``save_kv_layer`` advances the layerwise step counter
  and ``wait_for_save`` closes the forward (:mod:`tspd_vllm.layerwise`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.v1.request import RequestStatus

from tspd_core.pd import SOLO, GlooMesh
from tspd_vllm.arena import build_arena
from tspd_vllm.errors import UnsupportedModelError
from tspd_vllm.jobs import JobBatch
from tspd_vllm.scheduler import DecodeScheduler, PrefillScheduler, Scheduled
from tspd_vllm.settings import Role, Settings
from tspd_vllm.worker import DecodeSide, PrefillSide, Rank, Side

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: The KV cache specs the arena describes: every layer's page a (heads, tokens, content) cell
#: array of full attention, or one replicated latent (MLA). Exact types: vLLM's subclasses
#: (sinks, hidden-state caches, ...) keep more than the pages of a prompt.
MOVABLE = (FullAttentionSpec, MLAAttentionSpec)

#: A P request whose prompt is computed: it stopped on its own (not aborted or in error).
PREFILLED = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


class TspdMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's jobs, from the scheduler side to every worker (pickled)."""

    def __init__(self, batch: JobBatch) -> None:
        self.batch = batch


class TspdConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's KV connector moving KV with tspd (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_kv_cache(kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self.settings = Settings.from_config(tc.kv_role, tc.kv_connector_extra_config)
        self._producer = self.settings.role == Role.PREFILL
        self._model = vllm_config.model_config
        self._p: PrefillScheduler | None = None
        self._d: DecodeScheduler | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self._producer:
                self._p = PrefillScheduler(self.settings)
            else:
                self._d = DecodeScheduler()
        self._side: Side | None = None
        self._idle = False
        #: P streams layerwise: the step's jobs are taken before its forward.
        self._streams = self._producer and self.settings.layerwise_interval > 0
        self._taken = False  #: this step's metadata was handed to the side

    # -- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._d is None:
            if self._p is not None:
                prompt_len = len(request.prompt_token_ids or ())
                self._p.scheduling(request.request_id, request.kv_transfer_params, prompt_len)
            return 0, False
        prompt_len = len(request.prompt_token_ids or ())
        return self._d.matched(
            request.request_id, request.kv_transfer_params, prompt_len, num_computed_tokens
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._d is None or num_external_tokens <= 0:
            return
        self._d.allocated(
            request.request_id,
            request.kv_transfer_params,
            blocks.get_block_ids()[0],
            num_external_tokens,
            len(request.prompt_token_ids or ()),
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._p is not None:
            if not self._streams:
                return TspdMetadata(self._p.take())
            state = scheduler_output.kv_connector_block_state

            def blocks(rid: str) -> list[int]:
                ids = state.get_block_ids(rid) if state is not None else None
                assert ids is not None, f"request {rid}: vLLM offered no block row"
                return list(ids[0])

            return TspdMetadata(
                self._p.take(
                    scheduled(scheduler_output),
                    scheduler_output.preempted_req_ids or (),
                    blocks,
                )
            )
        assert self._d is not None, "build_connector_meta runs on the scheduler side"
        return TspdMetadata(self._d.take())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._p is not None:
            self._p.reported(connector_output.finished_sending or ())

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._d is not None:
            self._d.finished(request.request_id)
            return False, None
        assert self._p is not None, "request_finished runs on the scheduler side"
        output = request.output_token_ids
        return self._p.finished(
            request.request_id,
            request.kv_transfer_params,
            prefilled=request.status in PREFILLED,
            block_ids=block_ids,
            prompt_len=len(request.prompt_token_ids or ()),
            first_token=int(output[0]) if len(output) else None,
        )

    def has_pending_push_work(self) -> bool:
        return self._p is not None and self._p.pending()

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        arena = build_arena(
            kv_caches,
            total_kv_heads=self._model.get_total_num_kv_heads(),
            replicated=bool(self._model.use_mla),
        )
        rank = _rank()
        side_cls = PrefillSide if self._producer else DecodeSide
        self._side = side_cls(self.settings, arena, rank)
        log.info(
            "TspdConnector %s rank %d/%d: %d layers, %d blocks of %d tokens, %s pages, "
            "arena %d bytes",
            self.settings.role.name,
            rank.rank,
            rank.size,
            len(arena.layers),
            arena.num_blocks,
            arena.block_size,
            arena.order.value,
            arena.tensor.numel(),
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._taken = False

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        del kwargs
        self._idle = getattr(forward_context, "attn_metadata", None) is None
        self._take()

    def _take(self) -> None:
        """Hand the step's jobs to the side, once per step."""
        if self._taken or self._side is None or not self.has_connector_metadata():
            return
        self._taken = True
        meta = self._get_connector_metadata()
        assert isinstance(meta, TspdMetadata)
        self._side.take(meta.batch)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._producer:
            # Before the forward's first layer: the sends of prompts finished in earlier
            # steps go out while this forward runs (vLLM calls start_load_kv after it), and
            # layerwise rows are armed in time for it.
            self._take()

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        if self._streams and isinstance(self._side, PrefillSide):
            self._side.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        if self._streams and isinstance(self._side, PrefillSide):
            self._side.forward_done()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._side is None:
            return KVConnectorTransferResults()
        news = self._side.results(finished_req_ids, self._idle)
        return KVConnectorTransferResults(
            finished_sending=news.sending,
            finished_recving=news.recving,
            failed_recving=news.failed,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def shutdown(self) -> None:
        if self._side is not None:
            self._side.close()
            self._side = None


def scheduled(out: SchedulerOutput) -> list[Scheduled]:
    """The requests of a step's forward: where each starts, how many tokens it computes."""
    rows = [
        Scheduled(new.req_id, new.num_computed_tokens, out.num_scheduled_tokens.get(new.req_id, 0))
        for new in out.scheduled_new_reqs
    ]
    cached = out.scheduled_cached_reqs
    for rid, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
        rows.append(Scheduled(rid, computed, out.num_scheduled_tokens.get(rid, 0)))
    return rows


def check_kv_cache(config: KVCacheConfig | None) -> None:
    """Refuse, as vLLM builds the connector (start-up), a KV cache it cannot move whole:
    several KV cache groups (a hybrid model under vLLM's hybrid allocator, which this
    connector does not implement: no ``SupportsHMA``) or a group that is not full attention
    or MLA (sliding window, Mamba state, ...). :class:`UnsupportedModelError` names them."""
    if config is None:
        return
    kinds = [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups]
    movable = len(kinds) == 1 and type(config.kv_cache_groups[0].kv_cache_spec) in MOVABLE
    if not movable:
        raise UnsupportedModelError(
            "TspdConnector moves one KV cache group of full-attention or MLA layers; this "
            f"model's KV cache has {len(kinds)} group(s): {kinds} (hybrid models and "
            "sliding-window or state caches are not supported)"
        )


def _rank() -> Rank:
    """This worker's TP rank, and the gloo mesh and barrier of its TP group."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return Rank()
    cpu = group.cpu_group
    return Rank(
        size=group.world_size,
        rank=group.rank_in_group,
        mesh=GlooMesh([cpu]) if cpu is not None else SOLO,
        barrier=lambda: torch.distributed.barrier(group=cpu),
    )
