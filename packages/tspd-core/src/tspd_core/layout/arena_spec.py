"""What one rank caches and how it lays it out: the inputs of the layout recipe.

:class:`ArenaSpec` (with :class:`StateSpec` for GDN state layers) is read by
:mod:`tspd_core.layout.declare` (which fields) and :mod:`tspd_core.layout.recipe` (where they
go); both are documented there.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class AttentionKind(StrEnum):
    """MHA and GQA cache per-KV-head K and V; MLA caches one replicated latent per token."""

    MHA = "mha"
    GQA = "gqa"
    MLA = "mla"


class PageLayout(StrEnum):
    """Order of a K/V page: NHD = (tokens, heads, dim), HND = (heads, tokens, dim).

    NHD is the layout TokenSpeed's recipes use (partition axis 1), so it pairs with any
    TokenSpeed rank; HND (tspd only) makes one rank's head slice of a page a single contiguous
    run. The two do not pair with each other (docs/layout.md, "Page layouts").
    """

    NHD = "nhd"
    HND = "hnd"


class PlaneArrangement(StrEnum):
    """TokenSpeed's per-field planes, or tspd's page-major plane per group (module docstring)."""

    PER_FIELD = "per_field"
    PAGE_MAJOR = "page_major"


@dataclass(frozen=True, slots=True)
class StateSpec:
    """GDN-style recurrent-state layers (Qwen3.5), moved as the latest snapshot only.

    ``conv`` is ``(2·Kw + Vw, conv_width)`` split in parts ``[Kw, Kw, Vw]`` (Kw = key heads ·
    key dim, Vw = value heads · value dim), ``ssm`` is ``(value_heads, value_dim, key_dim)``
    (the kernels' K-last layout); both are split over TP on axis 0. The dtypes are
    TokenSpeed's defaults: a bf16 conv window, an fp32 recurrent state.
    """

    layers: tuple[int, ...]
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_width: int = 3
    conv_dtype: str = "bfloat16"
    ssm_dtype: str = "float32"
    checkpoint_granularity: int | None = None


@dataclass(frozen=True, slots=True)
class ArenaSpec:
    """What one rank caches and how it lays it out. Give ``num_pages`` or ``memory_bytes``.

    ``num_pages`` is the number of usable parents (``num_lcm_blocks``): a group packing K
    pages per parent gets ``K · num_pages`` usable pages (page 0, the null page, comes
    extra); K is 1 except for the attention group of a hybrid. ``memory_bytes`` sizes the
    arena from a byte budget instead. ``dtype`` is the K/V (or latent) compute dtype; fp8
    ones are stored as ``uint8``. ``page_alignment`` (bytes) defaults to 1, or 256 with state
    layers (TokenSpeed's alignments).
    """

    layers: int
    attention: AttentionKind = AttentionKind.GQA
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    page_size: int = 16
    tp_size: int = 1
    tp_rank: int = 0
    page_layout: PageLayout = PageLayout.NHD
    arrangement: PlaneArrangement = PlaneArrangement.PER_FIELD
    latent_dim: int = 512
    rope_dim: int = 64
    draft_layers: int = 0
    sliding_layers: tuple[int, ...] = ()
    sliding_window_tokens: int | None = None
    state: StateSpec | None = None
    num_pages: int | None = None
    memory_bytes: int | None = None
    page_alignment: int | None = None

    @property
    def total_layers(self) -> int:
        """Target plus draft layers (merged layer indices are ``0 .. total_layers−1``)."""
        return self.layers + self.draft_layers
