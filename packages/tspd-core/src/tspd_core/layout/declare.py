"""What one rank's arena holds, layer by layer: groups, fields, shapes, dtypes, partitions.

The field vocabulary is TokenSpeed's (wire.md §4), so a tspd rank and a TokenSpeed rank serving
the same model publish the same semantics:

* MHA/GQA: ``layer.<L>.k`` and ``layer.<L>.v``, one page ``(tokens, heads, dim)`` (NHD, what
  TokenSpeed uses) or ``(heads, tokens, dim)`` (HND, tspd's head-major choice), partitioned
  over the KV heads;
* MLA: one field ``layer.<L>.latent_kv`` of ``(tokens, 1, kv_lora_rank + rope_dim)`` — the
  compressed latent and the rope key side by side in one row, replicated on every rank;
* GDN state layers: ``layer.<L>.ssm`` ``(value_heads, value_dim, key_dim)`` and
  ``layer.<L>.conv`` ``(2·Kw + Vw, conv_width)`` (parts ``[Kw, Kw, Vw]``), split over TP on
  axis 0, in groups ``linear_attention_<i>``: the i-th state layer of every run of state
  layers between two attention layers (Qwen3.5 repeats state-0, state-1, state-2, full);
* fp8 K/V and latents are stored as ``uint8`` (the pools write them by elementwise scatter,
  which has no fp8 kernel, so that is the dtype the wire carries).

Groups come in order of first appearance over the layers (draft layers last, in
``full_attention``). Planes are named by the layer's *occurrence* in its group, as TokenSpeed
names them: ``unit.<n>.k``/``.v`` (MHA/GQA), ``slot.<n>`` (MLA), and for hybrids with state
``unit.<n>.a``/``.b`` (K or ssm / V or conv) — so the n-th layers of different groups share
a plane and take turns in its bytes (see :mod:`tspd_core.layout.packing`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tspd_core.layout.arena_spec import ArenaSpec, StateSpec
from tspd_core.layout.errors import ContractError
from tspd_core.layout.packing import Declared
from tspd_core.layout.parts import Partition

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LINEAR_ATTENTION = "linear_attention"
#: dtypes a pool writes by elementwise scatter stores as bytes (no fp8 scatter kernel)
_SCATTER_AS_BYTES = frozenset({"float8_e4m3fn", "float8_e5m2"})


@dataclass(frozen=True, slots=True)
class Field:
    """One declared field and its partition (``None``: replicated on every rank)."""

    decl: Declared
    partition: Partition | None

    @property
    def group_id(self) -> str:
        return self.decl.group_id

    @property
    def field_id(self) -> str:
        return self.decl.field_id


def stored_dtype(dtype: str) -> str:
    """The dtype a K/V or latent field is stored (and published) as: fp8 becomes ``uint8``."""
    return "uint8" if dtype in _SCATTER_AS_BYTES else dtype


def local_heads(heads: int, tp: int, what: str) -> int:
    """Per-rank share of ``heads`` over ``tp`` ranks (1, with replicas, when tp > heads).

    Refuses a split no deployment can use, with the reason TokenSpeed's planner gives for it.
    """
    if heads >= tp and heads % tp == 0:
        return heads // tp
    if heads < tp and tp % heads == 0:
        return 1
    local = max(heads // tp, 1)
    raise ContractError(
        f"{heads} {what} cannot be split evenly over TP {tp}: need TP to divide {heads} or be "
        f"a multiple of it (a rank holding {local} of them cannot map global extent {heads} and "
        f"local extent {local} to TP={tp})"
    )


def group_ids(spec: ArenaSpec) -> list[str]:
    """The group of every merged layer (target layers, then draft layers)."""
    state = set(spec.state.layers) if spec.state is not None else set()
    out, position = [], 0
    for layer in range(spec.total_layers):
        if layer in state:
            out.append(f"{LINEAR_ATTENTION}_{position}")
            position += 1
            continue
        position = 0
        sliding = layer < spec.layers and layer in spec.sliding_layers
        out.append(SLIDING_ATTENTION if sliding else FULL_ATTENTION)
    return out


def declare(spec: ArenaSpec) -> list[Field]:
    """Every field of the arena, layer by layer, with its (TokenSpeed-named) plane."""
    hybrid = spec.state is not None
    occurrences: dict[str, int] = {}
    out: list[Field] = []
    for layer, gid in enumerate(group_ids(spec)):
        n = occurrences.get(gid, 0)
        occurrences[gid] = n + 1
        if gid.startswith(LINEAR_ATTENTION):
            assert spec.state is not None, "state groups exist only with a state spec"
            out += _state(spec, spec.state, layer, gid, n)
        else:
            out += _attention(spec, layer, gid, n, hybrid)
    return out


def _attention(spec: ArenaSpec, layer: int, gid: str, n: int, hybrid: bool) -> list[Field]:
    dtype = stored_dtype(spec.dtype)
    if spec.attention == "mla":
        width = spec.latent_dim + spec.rope_dim
        shape = (spec.page_size, 1, width)
        return [Field(Declared(gid, f"layer.{layer}.latent_kv", f"slot.{n}", shape, dtype), None)]
    heads = local_heads(spec.kv_heads, spec.tp_size, "KV heads")
    if spec.page_layout == "hnd":
        shape, axis = (heads, spec.page_size, spec.head_dim), 0
    else:
        shape, axis = (spec.page_size, heads, spec.head_dim), 1
    part = Partition(axis, spec.kv_heads)
    planes = (f"unit.{n}.a", f"unit.{n}.b") if hybrid else (f"unit.{n}.k", f"unit.{n}.v")
    return [
        Field(Declared(gid, f"layer.{layer}.{suffix}", plane, shape, dtype), part)
        for suffix, plane in zip(("k", "v"), planes, strict=True)
    ]


def _state(spec: ArenaSpec, state: StateSpec, layer: int, gid: str, n: int) -> list[Field]:
    tp = spec.tp_size
    if state.key_heads % tp or state.value_heads % tp:
        raise ContractError(
            f"state heads ({state.key_heads} key, {state.value_heads} value) must divide by TP {tp}"
        )
    kw, vw = state.key_heads * state.key_head_dim, state.value_heads * state.value_head_dim
    ssm = Declared(
        gid,
        f"layer.{layer}.ssm",
        f"unit.{n}.a",
        (state.value_heads // tp, state.value_head_dim, state.key_head_dim),
        state.ssm_dtype,
    )
    conv = Declared(
        gid,
        f"layer.{layer}.conv",
        f"unit.{n}.b",
        ((2 * kw + vw) // tp, state.conv_width),
        state.conv_dtype,
        exact=False,  # the conv kernels take the page stride they are given
    )
    return [
        Field(ssm, Partition(0, state.value_heads)),
        Field(conv, Partition(0, 2 * kw + vw, (kw, kw, vw))),
    ]
