"""JSON wire forms of contracts (wire.md §4) and manifests (wire.md §5), in one place.

Encoding is Python ``json.dumps`` with ``(",", ":")`` separators, keys in wire.md §4.2's order,
ASCII only — byte-identical to TokenSpeed's Python peers. A contract's canonical form is
"parse, then re-serialize": :func:`canonical_contract`.

Parsing is strict where wire.md §4.2 says the reference is: ``groups``, ``planes``, ``fields`` and
``group_specs`` entries reject unknown and missing keys (group-spec members with defaults may be
absent); unknown keys elsewhere are ignored. Every failure raises :class:`ContractError` or
:class:`ManifestError` naming the JSON path.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from tspd_core.layout.contract import (
    CacheContract,
    Family,
    FieldLayout,
    FieldPartition,
    GroupLayout,
    GroupSpec,
    MemoryPlan,
    Partition,
    PlaneLayout,
    Retention,
    TransferPolicy,
    TransferSchema,
)
from tspd_core.layout.errors import ContractError, LayoutError, ManifestError
from tspd_core.layout.manifest import BlockManifest, GroupBlocks

MAX_CONTRACT_BYTES = 262144
MAX_MANIFEST_BYTES = 2097152

_GROUP_KEYS = ("group_id", "cache_blocks_per_lcm_block", "page_count")
_PLANE_KEYS = ("plane_id", "bytes_per_lcm_block", "arena_offset_bytes")
_FIELD_KEYS = (
    "group_id",
    "field_id",
    "plane_id",
    "shape",
    "dtype",
    "field_offset_bytes",
    "page_stride_bytes",
)
_SPEC_KEYS = (
    "group_id",
    "retention",
    "rows_per_page",
    "entry_stride_tokens",
    "sliding_window_tokens",
    "family",
    "transfer_policy",
    "checkpoint_granularity",
)
_SPEC_REQUIRED = ("group_id", "retention")

E = TypeVar("E", bound=LayoutError)
T = TypeVar("T")


def _dumps(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode("ascii")


def _loads(raw: bytes, what: str, limit: int, error: type[E]) -> dict[str, Any]:
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise error(f"{what}: expected bytes, got {type(raw).__name__}")
    if not 1 <= len(raw) <= limit:
        raise error(f"{what}: must be 1..{limit} bytes, got {len(raw)}")
    try:
        value = json.loads(bytes(raw))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{what}: not valid JSON ({exc})") from exc
    except RecursionError:  # b"[" * 100_000 from a peer: json recurses once per level
        raise error(f"{what}: nested too deeply to be a {what}") from None
    if not isinstance(value, dict):
        raise error(f"{what}: must be a JSON object, got {type(value).__name__}")
    return value


# ---- contract ------------------------------------------------------------------------------


def contract_to_obj(c: CacheContract) -> dict[str, object]:
    """The contract as plain JSON-ready objects, keys in wire.md §4.2's order."""
    plan = c.plan
    return {
        "plan": {
            "prefix_granularity": plan.prefix_granularity,
            "lcm_block_bytes": plan.lcm_block_bytes,
            "num_lcm_blocks": plan.num_lcm_blocks,
            "groups": [{k: getattr(g, k) for k in _GROUP_KEYS} for g in plan.groups],
            "planes": [{k: getattr(p, k) for k in _PLANE_KEYS} for p in plan.planes],
            "fields": [
                {k: list(f.shape) if k == "shape" else getattr(f, k) for k in _FIELD_KEYS}
                for f in plan.fields
            ],
        },
        "group_specs": [{k: _plain(getattr(s, k)) for k in _SPEC_KEYS} for s in c.group_specs],
        "transfer_schema": {
            "fields": [
                {
                    "field_id": e.field_id,
                    "partition": {
                        "axis": e.partition.axis,
                        "global_extent": e.partition.global_extent,
                        "global_parts": list(e.partition.global_parts),
                    },
                }
                for e in c.transfer_schema.fields
            ]
        },
    }


def _plain(value: object) -> object:
    return value.value if isinstance(value, Retention | Family | TransferPolicy) else value


def encode_contract(contract: CacheContract) -> bytes:
    """Canonical JSON bytes of ``contract`` (≤ 262144 bytes, else :class:`ContractError`)."""
    raw = _dumps(contract_to_obj(contract))
    if len(raw) > MAX_CONTRACT_BYTES:
        raise ContractError(
            f"contract: {len(raw)} bytes exceeds the wire limit of {MAX_CONTRACT_BYTES}"
        )
    return raw


def parse_contract(raw: bytes) -> CacheContract:
    """Parse and validate a peer's contract JSON (ours or TokenSpeed's)."""
    top = _loads(raw, "contract", MAX_CONTRACT_BYTES, ContractError)
    plan_obj = _obj(_need(top, "plan", "contract"), "plan")
    pg, lbb, nlb = (_need(plan_obj, k, "plan") for k in _PLAN_INTS)
    plan = MemoryPlan(
        prefix_granularity=_int(pg, "plan.prefix_granularity"),
        lcm_block_bytes=_int(lbb, "plan.lcm_block_bytes"),
        num_lcm_blocks=_int(nlb, "plan.num_lcm_blocks"),
        groups=_entries(plan_obj, "groups", "plan", _group),
        planes=_entries(plan_obj, "planes", "plan", _plane),
        fields=_entries(plan_obj, "fields", "plan", _field),
    )
    specs = _entries(top, "group_specs", "contract", _spec)
    schema_obj = _obj(_need(top, "transfer_schema", "contract"), "transfer_schema")
    schema = TransferSchema(_entries(schema_obj, "fields", "transfer_schema", _schema_field))
    return CacheContract(plan, specs, schema)


def canonical_contract(raw: bytes) -> bytes:
    """Parse then re-serialize: the canonical form peers compare byte for byte."""
    return encode_contract(parse_contract(raw))


def canonical_layout_text(text: str) -> str:
    """The KV bootstrap server's layout check (``PUT /route``'s ``cache_layout``): the strict
    contract parser, then the canonical text. A layout missing keys that have defaults
    canonicalises like the full one; anything :func:`parse_contract` refuses (and every
    layout TokenSpeed's server refuses) raises :class:`ContractError`."""
    try:
        raw = text.encode("ascii")
    except UnicodeEncodeError as exc:
        raise ContractError(
            f"contract: must be ASCII JSON, got {exc.reason} at {exc.start}"
        ) from exc
    return canonical_contract(raw).decode("ascii")


_PLAN_INTS = ("prefix_granularity", "lcm_block_bytes", "num_lcm_blocks")


def _obj(value: object, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ContractError(f"{path}: expected a JSON object, got {value!r:.60}")
    return value


def _need(obj: dict[str, Any], key: str, path: str) -> object:
    if key not in obj:
        raise ContractError(f"{path}: missing key {key!r}")
    return obj[key]


def _int(value: object, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ContractError(f"{path}: expected an integer, got {value!r:.60}")
    return value


def _str(value: object, path: str) -> str:
    if not isinstance(value, str):
        raise ContractError(f"{path}: expected a string, got {value!r:.60}")
    return value


def _opt_int(value: object, path: str) -> int | None:
    return None if value is None else _int(value, path)


def _entries(
    obj: dict[str, Any], key: str, path: str, parse: Callable[[dict[str, Any], str], T]
) -> tuple[T, ...]:
    items = _need(obj, key, path)
    if not isinstance(items, list):
        raise ContractError(f"{path}.{key}: expected a JSON array")
    return tuple(
        parse(_obj(item, f"{path}.{key}[{i}]"), f"{path}.{key}[{i}]")
        for i, item in enumerate(items)
    )


def _exact_keys(
    obj: dict[str, Any], path: str, keys: tuple[str, ...], required: tuple[str, ...]
) -> None:
    unknown = sorted(set(obj) - set(keys))
    if unknown:
        raise ContractError(f"{path}: unknown keys {unknown} (allowed: {list(keys)})")
    missing = [k for k in required if k not in obj]
    if missing:
        raise ContractError(f"{path}: missing keys {missing}")


def _group(obj: dict[str, Any], path: str) -> GroupLayout:
    _exact_keys(obj, path, _GROUP_KEYS, _GROUP_KEYS)
    return GroupLayout(
        _str(obj["group_id"], f"{path}.group_id"),
        _int(obj["cache_blocks_per_lcm_block"], f"{path}.cache_blocks_per_lcm_block"),
        _int(obj["page_count"], f"{path}.page_count"),
    )


def _plane(obj: dict[str, Any], path: str) -> PlaneLayout:
    _exact_keys(obj, path, _PLANE_KEYS, _PLANE_KEYS)
    return PlaneLayout(
        _str(obj["plane_id"], f"{path}.plane_id"),
        _int(obj["bytes_per_lcm_block"], f"{path}.bytes_per_lcm_block"),
        _int(obj["arena_offset_bytes"], f"{path}.arena_offset_bytes"),
    )


def _field(obj: dict[str, Any], path: str) -> FieldLayout:
    _exact_keys(obj, path, _FIELD_KEYS, _FIELD_KEYS)
    shape = obj["shape"]
    if not isinstance(shape, list):
        raise ContractError(f"{path}.shape: expected a JSON array, got {shape!r:.60}")
    return FieldLayout(
        group_id=_str(obj["group_id"], f"{path}.group_id"),
        field_id=_str(obj["field_id"], f"{path}.field_id"),
        plane_id=_str(obj["plane_id"], f"{path}.plane_id"),
        shape=tuple(_int(x, f"{path}.shape[{i}]") for i, x in enumerate(shape)),
        dtype=_str(obj["dtype"], f"{path}.dtype"),
        field_offset_bytes=_int(obj["field_offset_bytes"], f"{path}.field_offset_bytes"),
        page_stride_bytes=_int(obj["page_stride_bytes"], f"{path}.page_stride_bytes"),
    )


def _choice(value: object, kind: type[Retention | Family | TransferPolicy], path: str) -> Any:
    try:
        return kind(_str(value, path))
    except ValueError:
        raise ContractError(
            f"{path}: expected one of {[m.value for m in kind]}, got {value!r}"
        ) from None


def _spec(obj: dict[str, Any], path: str) -> GroupSpec:
    _exact_keys(obj, path, _SPEC_KEYS, _SPEC_REQUIRED)
    policy = obj.get("transfer_policy")
    return GroupSpec(
        group_id=_str(obj["group_id"], f"{path}.group_id"),
        retention=_choice(obj["retention"], Retention, f"{path}.retention"),
        rows_per_page=_opt_int(obj.get("rows_per_page"), f"{path}.rows_per_page"),
        entry_stride_tokens=_opt_int(obj.get("entry_stride_tokens"), f"{path}.entry_stride_tokens"),
        sliding_window_tokens=_opt_int(
            obj.get("sliding_window_tokens"), f"{path}.sliding_window_tokens"
        ),
        family=_choice(obj.get("family", "history"), Family, f"{path}.family"),
        transfer_policy=None
        if policy is None
        else _choice(policy, TransferPolicy, f"{path}.transfer_policy"),
        checkpoint_granularity=_opt_int(
            obj.get("checkpoint_granularity"), f"{path}.checkpoint_granularity"
        ),
    )


def _schema_field(obj: dict[str, Any], path: str) -> FieldPartition:
    part = _obj(_need(obj, "partition", path), f"{path}.partition")
    parts = _need(part, "global_parts", f"{path}.partition")
    if not isinstance(parts, list):
        raise ContractError(f"{path}.partition.global_parts: expected a JSON array")
    return FieldPartition(
        _str(_need(obj, "field_id", path), f"{path}.field_id"),
        Partition(
            axis=_int(_need(part, "axis", f"{path}.partition"), f"{path}.partition.axis"),
            global_extent=_int(
                _need(part, "global_extent", f"{path}.partition"),
                f"{path}.partition.global_extent",
            ),
            global_parts=tuple(
                _int(x, f"{path}.partition.global_parts[{i}]") for i, x in enumerate(parts)
            ),
        ),
    )


# ---- manifest ------------------------------------------------------------------------------


def encode_manifest(manifest: BlockManifest) -> bytes:
    """Compact JSON of ``manifest`` (wire.md §5); :class:`ManifestError` past 2097152 bytes."""
    groups = ",".join(
        f'{{"group_id":{json.dumps(g.group_id)},"block_ids":[{_ids_text(g.block_ids)}]}}'
        for g in manifest.groups
    )
    raw = (
        f'{{"groups":[{groups}],"prefix_len":{manifest.prefix_len},'
        f'"prompt_len":{manifest.prompt_len}}}'
    ).encode("ascii")
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"manifest: {len(raw)} bytes exceeds the wire limit of {MAX_MANIFEST_BYTES}"
        )
    return raw


def _ids_text(ids: object) -> str:
    assert isinstance(ids, np.ndarray)
    return ",".join(map(str, ids.tolist()))


def parse_manifest(raw: bytes) -> BlockManifest:
    """Parse a manifest's JSON; types only — check it with ``validate_manifest`` next.

    An empty frame is the dummy rendezvous of wire.md §2.2 and is not a manifest: the caller
    handles it before parsing (this raises :class:`ManifestError` for it).
    """
    top = _loads(raw, "manifest", MAX_MANIFEST_BYTES, ManifestError)
    for key in ("groups", "prefix_len", "prompt_len"):
        if key not in top:
            raise ManifestError(f"manifest: missing key {key!r}")
    if not isinstance(top["groups"], list):
        raise ManifestError("manifest.groups: expected a JSON array")
    groups = tuple(_manifest_group(g, i) for i, g in enumerate(top["groups"]))
    lens = []
    for key in ("prefix_len", "prompt_len"):
        value = top[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ManifestError(f"manifest.{key}: expected an integer ≥ 0, got {value!r:.60}")
        lens.append(value)
    return BlockManifest(groups, lens[0], lens[1])


def _manifest_group(obj: object, i: int) -> GroupBlocks:
    path = f"manifest.groups[{i}]"
    if not isinstance(obj, dict) or "group_id" not in obj or "block_ids" not in obj:
        raise ManifestError(f"{path}: expected an object with group_id and block_ids")
    gid, ids = obj["group_id"], obj["block_ids"]
    if not isinstance(gid, str):
        raise ManifestError(f"{path}.group_id: expected a string, got {gid!r:.60}")
    if not isinstance(ids, list) or not all(type(x) is int for x in ids):
        raise ManifestError(f"{path}.block_ids: expected an array of integers")
    if ids and (min(ids) < 0 or max(ids) >= 1 << 62):
        raise ManifestError(f"{path}.block_ids: ids must lie in 0..2**62")
    return GroupBlocks(gid, np.array(ids, dtype=np.int64))
