"""Layout planner: cache transfer contracts, block manifests, routes and copy descriptors.

numpy only (no torch, no sockets), so the simulator can use the same planner as the peers.
See docs/layout.md for the API tour, the page-address diagram and the route rules.
"""

from tspd_core.layout.codec import (
    MAX_CONTRACT_BYTES,
    MAX_MANIFEST_BYTES,
    canonical_contract,
    canonical_layout_text,
    encode_contract,
    encode_manifest,
    parse_contract,
    parse_manifest,
)
from tspd_core.layout.compat import check_compatible
from tspd_core.layout.contract import (
    DTYPE_WIDTHS,
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
from tspd_core.layout.copies import DEFAULT_BATCH, Copies, iter_batches, plan_copies
from tspd_core.layout.errors import (
    ContractError,
    ContractMismatch,
    LayoutError,
    ManifestError,
    RouteError,
)
from tspd_core.layout.manifest import (
    BlockManifest,
    GroupBlocks,
    build_manifest,
    chunk_positions,
    slot_range,
    validate_manifest,
)
from tspd_core.layout.models import deepseek_v3, llama3_8b, llama3_70b
from tspd_core.layout.recipe import (
    ArenaSpec,
    AttentionKind,
    PageLayout,
    PlaneArrangement,
    StateSpec,
    build_contract,
)
from tspd_core.layout.routes import (
    FieldRoute,
    Fragment,
    LinkRoute,
    RoutePlan,
    plan_routes,
    prefill_dp_group,
)
from tspd_core.layout.stats import (
    LinkProfile,
    PairCounter,
    TransferStats,
    link_profile,
    route_stats,
    transfer_stats,
)
from tspd_core.layout.strided import Runs, plan_runs
from tspd_core.layout.views import FieldGeometry, field_geometry, field_view, numpy_dtype

__all__ = [
    "DEFAULT_BATCH",
    "DTYPE_WIDTHS",
    "MAX_CONTRACT_BYTES",
    "MAX_MANIFEST_BYTES",
    "ArenaSpec",
    "AttentionKind",
    "BlockManifest",
    "CacheContract",
    "ContractError",
    "ContractMismatch",
    "Copies",
    "Family",
    "FieldGeometry",
    "FieldLayout",
    "FieldPartition",
    "FieldRoute",
    "Fragment",
    "GroupBlocks",
    "GroupLayout",
    "GroupSpec",
    "LayoutError",
    "LinkProfile",
    "LinkRoute",
    "ManifestError",
    "MemoryPlan",
    "PageLayout",
    "PairCounter",
    "Partition",
    "PlaneArrangement",
    "PlaneLayout",
    "Retention",
    "RouteError",
    "RoutePlan",
    "Runs",
    "StateSpec",
    "TransferPolicy",
    "TransferSchema",
    "TransferStats",
    "build_contract",
    "build_manifest",
    "canonical_contract",
    "canonical_layout_text",
    "check_compatible",
    "chunk_positions",
    "deepseek_v3",
    "encode_contract",
    "encode_manifest",
    "field_geometry",
    "field_view",
    "iter_batches",
    "link_profile",
    "llama3_8b",
    "llama3_70b",
    "numpy_dtype",
    "parse_contract",
    "parse_manifest",
    "plan_copies",
    "plan_routes",
    "plan_runs",
    "prefill_dp_group",
    "route_stats",
    "slot_range",
    "transfer_stats",
    "validate_manifest",
]
