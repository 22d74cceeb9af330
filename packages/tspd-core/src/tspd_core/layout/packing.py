"""Packing declared fields into one physical parent (the LCM block) — TokenSpeed's rules.

A recipe declares, per group, the fields one page of that group holds and the plane each lives
in; planes may be shared between groups (a hybrid model's state groups and its attention group
take turns in the same plane). This module decides how many pages of each group one parent
holds (the group's packing ``K``), how many bytes each plane takes per parent, and where each
field sits in its page. The rules are the ones TokenSpeed's cache planner applies, so a
contract tspd builds for a model TokenSpeed also serves is byte-for-byte the one TokenSpeed
builds (``tests/interop`` compares them)::

    plane unit.0.a, one parent (2 MiB):
      full_attention (K=16) | k pg | k pg | ... 16 pages of 128 KiB ... |
      linear_attention_0 (K=1) | ssm page (2 MiB)                        |
      linear_attention_1 (K=1) | ssm page (2 MiB)                        |   (the same bytes:
                                                                             groups never own
                                                                             one page id twice)

* **Packing.** Unless the recipe pins it, ``K`` of a group starts as the largest group's bytes
  per page over its own (at least 1). Fields with an *exact* page stride (their kernel walks
  pages by the payload size) then force ``K_a · bytes_a = K_b · bytes_b`` between the groups
  sharing a plane; the smallest integer solution of those equations replaces the start values
  of the groups they tie together (an inconsistent system leaves the start values, and the
  stride check below then refuses). A group without exact fields takes the largest ``K`` that
  divides the bytes the other groups fixed in every plane it uses.
* **Planes.** A group's fields sit side by side in a plane (each at a multiple of its element
  width); the plane holds ``max(K · group bytes)`` over its groups, rounded up to the least
  common multiple of the alignment and every ``K · element width``.
* **Parent.** The planes' sum, rounded up to a multiple of the alignment and of every ``K``;
  every group's page stride in a plane is the plane's bytes over its ``K``, and a group may
  waste at most ``max_padding`` of its own bytes per page.

Pure integer arithmetic, no state: call from any thread.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from tspd_core.layout.errors import ContractError
from tspd_core.layout.parts import DTYPE_WIDTHS


@dataclass(frozen=True, slots=True)
class Declared:
    """One field a group declares: its page shape, dtype and plane (not yet placed)."""

    group_id: str
    field_id: str
    plane_id: str
    shape: tuple[int, ...]
    dtype: str
    #: True when the field's pages must lie exactly one payload apart (kernels that walk pages
    #: by an implicit stride); False when any stride at least the payload will do.
    exact: bool = True

    @property
    def itemsize(self) -> int:
        return DTYPE_WIDTHS[self.dtype]

    @property
    def payload(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True, slots=True)
class Packed:
    """Where everything sits in one parent."""

    lcm_block_bytes: int
    packing: dict[str, int]  #: group id -> pages per parent (K)
    plane_bytes: dict[str, int]  #: plane id -> bytes per parent
    offsets: dict[str, int]  #: field id -> offset inside its page
    strides: dict[str, int]  #: field id -> page stride


def _lcm(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def pack(
    fields: list[Declared],
    *,
    alignment: int,
    max_padding: float,
    pinned: Mapping[str, int] | None = None,
) -> Packed:
    """Pack ``fields`` (see the module docstring); :class:`ContractError` when they cannot be.

    ``pinned`` fixes ``K`` of the groups it names (a recipe that owns the policy pins all).
    """
    order = sorted(fields, key=lambda f: (f.plane_id, f.group_id, f.field_id))
    raw: dict[str, int] = {}
    for f in order:
        raw[f.group_id] = raw.get(f.group_id, 0) + f.payload
    offsets, group_bytes = _offsets(order)
    pinned = dict(pinned or {})
    if set(pinned) == set(raw):
        packing = pinned
    else:
        packing = _start_packing(raw)
        packing.update(_exact_ties(order) or {})
        if not pinned:
            _fit_flexible(order, packing, group_bytes, alignment)
        packing.update(pinned)
    planes = _plane_bytes(order, packing, group_bytes, alignment)
    strides = {f.field_id: planes[f.plane_id] // packing[f.group_id] for f in order}
    for f in order:
        if f.exact and strides[f.field_id] != f.payload:
            raise ContractError(
                f"field {f.field_id} needs page stride {f.payload} (its pages lie one payload "
                f"apart) but plane {f.plane_id} gives its group {strides[f.field_id]}; move one "
                "of the plane's fields to another plane or align their payloads"
            )
    parent = _align(sum(planes.values()), _lcm([alignment, *packing.values()]))
    for gid in sorted(raw):
        stride = parent // packing[gid]
        waste = (stride - raw[gid]) / raw[gid]
        if waste > max_padding:
            raise ContractError(
                f"group {gid}: a page of {raw[gid]} bytes takes a {stride}-byte slot of the "
                f"parent, padding {waste:.6f} of it, over the limit {max_padding:.6f}"
            )
    return Packed(parent, packing, planes, offsets, strides)


def _offsets(order: list[Declared]) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Field offsets inside a page, and each group's bytes per page in each plane."""
    offsets: dict[str, int] = {}
    group_bytes: dict[str, dict[str, int]] = {}
    for f in order:
        in_plane = group_bytes.setdefault(f.group_id, {})
        at = _align(in_plane.get(f.plane_id, 0), f.itemsize)
        offsets[f.field_id] = at
        in_plane[f.plane_id] = at + f.payload
    return offsets, group_bytes


def _start_packing(raw: dict[str, int]) -> dict[str, int]:
    largest = max(raw.values())
    return {gid: max(1, largest // size) for gid, size in raw.items()}


def _exact_ties(order: list[Declared]) -> dict[str, int] | None:
    """The smallest integer K per tied group that equalises exact bytes in shared planes, or
    ``None`` when the equations contradict each other."""
    exact: dict[str, dict[str, int]] = {}  # plane -> group -> exact bytes
    for f in order:
        if f.exact:
            tenants = exact.setdefault(f.plane_id, {})
            tenants[f.group_id] = tenants.get(f.group_id, 0) + f.payload
    edges: dict[str, list[tuple[str, Fraction]]] = {}  # K_b = ratio · K_a
    for tenants in exact.values():
        ids = sorted(tenants)
        for a, b in itertools.pairwise(ids):
            ratio = Fraction(tenants[a], tenants[b])
            edges.setdefault(a, []).append((b, ratio))
            edges.setdefault(b, []).append((a, 1 / ratio))
    weight: dict[str, Fraction] = {}
    out: dict[str, int] = {}
    for root in sorted(edges):
        if root in weight:
            continue
        component, stack = [root], [root]
        weight[root] = Fraction(1)
        while stack:
            a = stack.pop()
            for b, ratio in edges[a]:
                if b not in weight:
                    weight[b] = weight[a] * ratio
                    component.append(b)
                    stack.append(b)
                elif weight[b] != weight[a] * ratio:
                    return None
        scale = _lcm(weight[g].denominator for g in component)
        counts = {g: int(weight[g] * scale) for g in component}
        common = math.gcd(*counts.values())
        out.update({g: c // common for g, c in counts.items()})
    return out


def _fit_flexible(
    order: list[Declared],
    packing: dict[str, int],
    group_bytes: dict[str, dict[str, int]],
    alignment: int,
) -> None:
    """Groups with no exact field fill the planes the others fixed: the largest K that fits."""
    exact_groups = {f.group_id for f in order if f.exact}
    flexible = sorted({f.group_id for f in order} - exact_groups)
    if not flexible:
        return
    fixed = _plane_bytes(
        [f for f in order if f.group_id in exact_groups], packing, group_bytes, alignment
    )
    for gid in flexible:
        planes = group_bytes[gid]
        if not all(p in fixed for p in planes):
            continue
        widths = {
            p: _lcm(f.itemsize for f in order if f.group_id == gid and f.plane_id == p)
            for p in planes
        }
        upper = min(fixed[p] // size for p, size in planes.items())
        for count in range(upper, 0, -1):
            if all(fixed[p] % (count * widths[p]) == 0 for p in planes):
                packing[gid] = count
                break


def _plane_bytes(
    order: list[Declared],
    packing: dict[str, int],
    group_bytes: dict[str, dict[str, int]],
    alignment: int,
) -> dict[str, int]:
    need: dict[str, int] = {}
    grain: dict[str, int] = {}
    for f in order:
        k = packing[f.group_id]
        need[f.plane_id] = max(need.get(f.plane_id, 0), k * group_bytes[f.group_id][f.plane_id])
        grain[f.plane_id] = _lcm([grain.get(f.plane_id, alignment), k * f.itemsize])
    return {p: _align(need[p], grain[p]) for p in sorted(need)}
