"""One rank's KV arena: one contiguous uint8 tensor, laid out by tspd's layout recipe.

The arena is built from the rank's :class:`~tspd_core.layout.contract.CacheContract` (the same
contract the PD peers exchange), so the bytes the model writes are exactly where a transfer
worker's Mooncake descriptors point. Each layer's K and V are strided torch views into it::

    arena (uint8, one allocation, share_memory_() on CPU)
    ├─ plane unit.0.k : page 0 (null) | page 1 | page 2 | ...   page = [P, kv_heads, D] (NHD)
    ├─ plane unit.0.v : ...
    └─ ...            (page_major: one plane, all fields of a page side by side)

Token-major (NHD) pages are the default, the order TokenSpeed's arenas have, so a node pairs
with TokenSpeed peers as it starts; head-major (HND) pages (``--page-layout hnd``) make a head
slice of a page one contiguous run, which re-slicing between unequal TP sizes wants (tspd peers
only). Views always come out as ``[pages, kv_heads, P, D]``; an NHD arena is viewed through a
permutation.

Ownership: the engine thread writes through the views; a transfer worker process may map the
same bytes (``share_memory_()`` on CPU, CUDA IPC on GPU). Page 0 is the null page and stays
zero.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from tspd_core.feed import to_device
from tspd_core.layout.contract import CacheContract
from tspd_core.layout.recipe import ArenaSpec, AttentionKind, build_contract
from tspd_core.layout.views import field_geometry
from tspd_engine.config import EngineConfig
from tspd_engine.model.config import ModelConfig
from tspd_serving.errors import ConfigError

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def arena_spec(model: ModelConfig, engine: EngineConfig, rank: int) -> ArenaSpec:
    """The layout recipe's description of this rank's arena (GQA, one group, KV heads split)."""
    return ArenaSpec(
        layers=model.num_hidden_layers,
        attention=AttentionKind.GQA,
        kv_heads=model.num_key_value_heads,
        head_dim=model.head_dim,
        dtype=model.dtype,
        page_size=engine.page_size,
        tp_size=engine.tp,
        tp_rank=rank,
        page_layout=engine.page_layout,
        arrangement=engine.arrangement,
        num_pages=engine.num_pages,
    )


class KvArena:
    """The arena tensor and its per-layer ``[pages, kv_heads, P, D]`` K/V views."""

    def __init__(self, contract: CacheContract, layers: int, device: torch.device) -> None:
        self.contract = contract
        self.device = device
        self.tensor = torch.zeros(contract.plan.arena_bytes, dtype=torch.uint8, device=device)
        if device.type == "cpu":
            # A transfer worker process maps the same pages (docs/ARCHITECTURE.md, "Processes
            # on one rank").
            self.tensor.share_memory_()  # type: ignore[no-untyped-call]
        self._views = [
            (self._view(f"layer.{i}.k"), self._view(f"layer.{i}.v")) for i in range(layers)
        ]
        self.page_size = self._views[0][0].shape[2]
        self.page_count = self._views[0][0].shape[0]

    @classmethod
    def build(cls, model: ModelConfig, engine: EngineConfig, rank: int) -> KvArena:
        device = torch.device(engine.device)
        contract = build_contract(arena_spec(model, engine, rank))
        return cls(contract, model.num_hidden_layers, device)

    def _view(self, field_id: str) -> torch.Tensor:
        geo = field_geometry(self.contract, field_id)
        dtype = _TORCH_DTYPES.get(geo.dtype)
        if dtype is None:
            raise ConfigError(f"arena field {field_id} has dtype {geo.dtype}, not a compute dtype")
        size = geo.itemsize
        if geo.page0_offset % size or any(s % size for s in geo.strides_bytes):
            raise ConfigError(f"arena field {field_id} is not aligned to its {size}-byte dtype")
        typed = self.tensor.view(dtype)
        view = typed.as_strided(
            (geo.page_count, *geo.shape),
            tuple(s // size for s in geo.strides_bytes),
            geo.page0_offset // size,
        )
        # HND fields are [heads, P, D] per page already; NHD ones are [P, heads, D].
        part = self.contract.partition(field_id)
        return view.permute(0, 2, 1, 3) if part is not None and part.axis == 1 else view

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s (K, V) views, ``[page_count, kv_heads, P, D]`` each."""
        return self._views[layer]

    def zero_pages(self, pages: npt.NDArray[np.integer]) -> None:
        """Zero every field of ``pages`` (pages about to receive remote KV, wire.md §2.2)."""
        if len(pages) == 0:
            return
        idx = to_device(np.asarray(pages, dtype=np.int64), self.device)
        for k, v in self._views:
            k[idx] = 0
            v[idx] = 0

    def copy_pages(self, src: npt.NDArray[np.integer], dst: npt.NDArray[np.integer]) -> None:
        """Copy every field of page ``src[i]`` onto ``dst[i]`` (copy-on-write of shared pages)."""
        if len(src) != len(dst):
            raise ValueError(f"copy_pages: {len(src)} sources but {len(dst)} destinations")
        if len(src) == 0:
            return
        s = to_device(np.asarray(src, dtype=np.int64), self.device)
        d = to_device(np.asarray(dst, dtype=np.int64), self.device)
        for k, v in self._views:
            k[d] = k[s]
            v[d] = v[s]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def data_ptr(self) -> int:
        """Base address of the arena (what a transfer engine registers)."""
        return self.tensor.data_ptr()
