"""Cluster description: P and D instance groups, and how their memory becomes KV pages.

An **instance** is one serving replica: ``tp × dp`` GPUs of one kind. With ``dp > 1`` it runs
DP attention: ``dp`` independent **engines** (one scheduler, one block pool and one step clock
each) of ``tp`` attention ranks, while the weights are sharded over all ``tp × dp`` GPUs (the
MLP / MoE part is parallel over the whole instance). The synchronisation between the DP groups
of one instance (their shared MLP collectives) is not modelled. A request's room picks the DP
group on both sides: ``room % dp`` (wire.md §6.4).

A group spec reads ``COUNTxTP[dpDP][@GPU]``, e.g. ``4xtp2@h100``, ``1xtp8dp8@h200``, ``2x1``.
``GPU`` is a built-in name or the name of a GPU read from a spec file (``--gpu-spec``); the
model is a built-in name or a :class:`~tspd_sim.specs.ModelSpec` read from a file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from tspd_core.layout import PageLayout, PlaneArrangement
from tspd_sim.errors import SpecError
from tspd_sim.specs import GpuSpec, ModelSpec, gpu_name, gpu_spec, model_name, model_spec

#: Preemption policies of a decode engine out of pages.
PREEMPTION = ("recompute", "swap")

_GROUP = re.compile(r"^(\d+)x(?:tp)?(\d+)(?:dp(\d+))?(?:@([a-z0-9_-]+))?$")


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """``count`` identical instances of ``tp × dp`` GPUs of type ``gpu`` (a built-in name or a
    :class:`~tspd_sim.specs.GpuSpec`)."""

    count: int
    tp: int = 1
    dp: int = 1
    gpu: str | GpuSpec = "h100"

    def __post_init__(self) -> None:
        if self.count < 1 or self.tp < 1 or self.dp < 1:
            raise SpecError(f"instance group {self.label()}: count, tp and dp must all be ≥ 1")
        if self.tp > 8:
            raise SpecError(f"instance group {self.label()}: the layout planner supports TP 1..8")
        node = gpu_spec(self.gpu).gpus_per_node
        if self.tp > node:
            raise SpecError(
                f"instance group {self.label()}: TP {self.tp} spans more than one node of "
                f"{node} {gpu_name(self.gpu)} GPUs (TP runs over the intra-node link)"
            )

    @property
    def gpu_spec(self) -> GpuSpec:
        return gpu_spec(self.gpu)

    @property
    def gpus(self) -> int:
        """GPUs in the whole group."""
        return self.count * self.tp * self.dp

    def label(self) -> str:
        dp = f"dp{self.dp}" if self.dp > 1 else ""
        return f"{self.count}xtp{self.tp}{dp}@{gpu_name(self.gpu)}"


def parse_group(
    text: str,
    gpus: Mapping[str, GpuSpec] | None = None,
    default_gpu: str | GpuSpec = "h100",
) -> GroupSpec:
    """Parse ``COUNTxTP[dpDP][@GPU]`` (case-insensitive), e.g. ``4xtp2@h100``.

    ``GPU`` names one of ``gpus`` (GPUs read from spec files; they shadow built-ins of the same
    name) or a built-in GPU; without ``@GPU`` the group runs on ``default_gpu``.
    """
    m = _GROUP.match(text.strip().lower())
    if m is None:
        raise SpecError(
            f"bad instance group {text!r}; write COUNTxTP[dpDP][@GPU], "
            f"e.g. 4xtp2@h100 or 1xtp8dp8@h200"
        )
    count, tp, dp, name = m.groups()
    gpu: str | GpuSpec = default_gpu
    if name is not None:
        gpu = (gpus or {}).get(name, name)
    return GroupSpec(int(count), int(tp), int(dp or 1), gpu)


@dataclass(frozen=True, slots=True)
class EngineTuning:
    """Serving-engine settings shared by every instance.

    The names and enums are the reference engine's (``tspd_engine.config.EngineConfig``,
    whose words are SGLang's and vLLM's): a setting both have is spelled the same, and a
    setting whose value differs between the roles (P and D engines hold different numbers of
    requests) is the engine's word prefixed with the role, as the launcher's ``--prefill-tp``
    and ``--decode-tp`` are. The defaults describe what tspd's own cluster does (D decodes in
    rounds, the router passes P's first token on); the sizes (pages, prefill budget, running
    requests) are those of a GPU deployment, not the engine's CPU-sized defaults
    (``tests/test_sim_engine_defaults.py`` lists every shared setting and which differ).
    ``page_layout`` and ``arrangement`` accept their enum's string values too.
    """

    #: Tokens per KV page (64: FlashMLA's page and the layout planner's DeepSeek-V3 recipe;
    #: engines commonly use 16-128). Pages are the unit of prefix reuse, so the trace's prefix
    #: block (512 for Mooncake) should be a multiple of it.
    page_size: int = 64
    #: Prompt tokens one prefill step may compute (chunked prefill splits longer prompts).
    max_prefill_tokens: int = 8192
    #: Most requests one P engine holds at once (prefilling or waiting for their transfer).
    prefill_max_running: int = 64
    #: Most requests one D engine holds at once (waiting for KV or decoding).
    decode_max_running: int = 256
    #: Fraction of GPU memory for weights + KV (the rest: activations, CUDA graphs, NCCL).
    mem_fraction: float = 0.9
    #: Stream KV layer by layer while the prefill runs (tspd's default on a GPU) instead of
    #: afterwards.
    layerwise: bool = True
    #: P keeps prompt pages in its prefix store, so later prompts sharing them compute less.
    prefill_prefix_cache: bool = True
    #: D keeps received prompt pages in its prefix store, so later requests transfer less.
    decode_prefix_cache: bool = True
    #: KV page layout: NHD (tokens, heads, dim: what a tspd node uses by default, and
    #: TokenSpeed's and SGLang's only order) or HND (heads, tokens, dim: a head slice of a
    #: page is one run; tspd nodes started with ``--page-layout hnd``). Between unequal TP
    #: sizes NHD moves one run per token and head slice, each priced as a descriptor (a
    #: TokenSpeed peer's writes); two tspd nodes stage such routes instead (gather, one bulk
    #: write, scatter), which is not modelled: HND is the closer model of that pair.
    page_layout: PageLayout = PageLayout.NHD
    #: Arena planes: PER_FIELD (one plane per layer's K/V, layerwise-friendly) or PAGE_MAJOR
    #: (a page of every layer side by side: one run per page at equal TP).
    arrangement: PlaneArrangement = PlaneArrangement.PER_FIELD
    #: D admits a request only when the pages for its whole output are free as well, so decode
    #: never runs out of pages (the simulator knows output lengths; a real engine estimates).
    reserve_output: bool = True
    #: What D does when decode runs out of pages (only without ``reserve_output``): "recompute"
    #: (drop the newest request's KV, re-prefill it on D later) or "swap" (copy its KV to host
    #: memory over the host link, back later). See :mod:`tspd_sim.sim.preempt`.
    preemption: str = "recompute"
    #: D works in rounds, as tspd's reference engine (and SGLang's and vLLM's schedulers)
    #: do: a request routed to a D engine that is stepping is admitted at its next step
    #: boundary, and a request's first token leaves D with the end of its first decode step
    #: (the round that seeds it runs that step), not when its KV lands. Off: both at once.
    decode_rounds: bool = True
    #: The first token leaves P as its prefill ends, as tspd's router passes the token in P's
    #: answer on at once (``RouterConfig.early_first_token``; docs/router.md): TTFT leaves
    #: out the transfer and D's queue. Off: a router started with ``--hold-first-token``,
    #: where the first token leaves D.
    early_first_token: bool = True
    #: KV pages of every engine (one DP group), as an engine's ``--num-pages`` fixes them;
    #: 0: what the GPU's memory holds after the weights (:func:`pages_for`).
    num_pages: int = 0

    def __post_init__(self) -> None:
        # Strings name the enum members (call sites and CLI values predate the enums).
        layout = _member(PageLayout, self.page_layout, "page_layout")
        object.__setattr__(self, "page_layout", layout)
        planes = _member(PlaneArrangement, self.arrangement, "arrangement")
        object.__setattr__(self, "arrangement", planes)
        if self.page_size < 1 or self.max_prefill_tokens < self.page_size:
            raise SpecError(f"page_size {self.page_size} must be ≥ 1 and ≤ max_prefill_tokens")
        if self.prefill_max_running < 1 or self.decode_max_running < 1:
            raise SpecError("prefill_max_running and decode_max_running must be ≥ 1")
        if not 0 < self.mem_fraction <= 1:
            raise SpecError(f"mem_fraction {self.mem_fraction}: must be in (0, 1]")
        if self.num_pages < 0:
            raise SpecError(f"num_pages {self.num_pages}: must be ≥ 0 (0: from GPU memory)")
        if self.preemption not in PREEMPTION:
            raise SpecError(f"preemption {self.preemption!r}: use one of {PREEMPTION}")


_E = TypeVar("_E", PageLayout, PlaneArrangement)


def _member(enum: type[_E], value: str, name: str) -> _E:
    """``value`` (of field ``name``) as a member of ``enum``: a member, or its string value."""
    try:
        return enum(value)
    except ValueError:
        names = " or ".join(repr(m.value) for m in enum)
        raise SpecError(f"{name} {value!r}: use {names}") from None


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """The model (a built-in name or a :class:`~tspd_sim.specs.ModelSpec`), the P groups and
    the D groups (each non-empty)."""

    model: str | ModelSpec = "llama-3-8b"
    prefill: tuple[GroupSpec, ...] = (GroupSpec(4),)
    decode: tuple[GroupSpec, ...] = (GroupSpec(4),)
    tuning: EngineTuning = field(default_factory=EngineTuning)

    def __post_init__(self) -> None:
        model = model_spec(self.model)
        if not self.prefill or not self.decode:
            raise SpecError("a cluster needs at least one prefill and one decode group")
        for g in (*self.prefill, *self.decode):
            check_tp(model, g.tp)
            pages_for(model, g, self.tuning)  # fails early if nothing fits

    @property
    def model_spec(self) -> ModelSpec:
        return model_spec(self.model)

    @property
    def gpus(self) -> int:
        return sum(g.gpus for g in (*self.prefill, *self.decode))

    def label(self) -> str:
        p = "+".join(g.label() for g in self.prefill)
        d = "+".join(g.label() for g in self.decode)
        return f"{model_name(self.model)} P[{p}] D[{d}]"


def check_tp(model: ModelSpec, tp: int) -> None:
    """Refuse a TP the model cannot be split over: its attention heads must divide by TP, and
    its KV heads divide by TP or TP by them (then each rank holds one replicated KV head; the
    layout planner's rule). An MLA latent is replicated on every rank."""
    if model.heads % tp:
        raise SpecError(
            f"{model.name}: TP {tp} does not divide its {model.heads} attention heads; "
            "use a TP that does"
        )
    kv = model.kv_heads
    if model.mla is None and kv % tp and tp % kv:
        raise SpecError(
            f"{model.name}: its {kv} KV heads cannot be split over TP {tp} (TP must divide "
            f"{kv} or be a multiple of it)"
        )


def pages_for(model: ModelSpec, group: GroupSpec, tuning: EngineTuning) -> int:
    """KV pages of one engine (one DP group): GPU memory after weights, per attention rank.

    ``mem_fraction · memory − weights / (tp·dp)`` bytes per GPU, divided by one page's bytes on
    one rank; every rank of an engine holds the same page ids (one block pool per engine).
    ``tuning.num_pages`` (> 0) sets the count instead, as an engine's ``--num-pages`` does.
    """
    if tuning.num_pages:
        if tuning.num_pages < 2:
            raise SpecError(f"num_pages {tuning.num_pages}: an engine needs ≥ 2 pages")
        return tuning.num_pages
    gpu = gpu_spec(group.gpu)
    free = gpu.memory * tuning.mem_fraction - model.weight_bytes_per_gpu(group.tp * group.dp)
    page_bytes = model.kv_bytes_per_token(group.tp) * tuning.page_size
    pages = int(free // page_bytes)
    if pages < 2:
        raise SpecError(
            f"{model.name} does not fit on {group.label()}: {free / 1e9:.1f} GB per GPU left "
            f"after weights; use more TP/DP, a larger GPU or a higher mem_fraction"
        )
    return pages
