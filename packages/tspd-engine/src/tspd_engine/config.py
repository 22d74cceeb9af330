"""What one engine replica runs with (a frozen dataclass): the model, the KV pages, TP, the
device feed. Every rank of a replica gets the same config, so every rank's scheduler makes the
same decisions. Validated eagerly: :class:`ConfigError` names the offending value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tspd_core.layout import PageLayout, PlaneArrangement
from tspd_engine.model.config import ModelConfig
from tspd_serving.errors import ConfigError


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What one engine replica (a TP group of ranks) runs with.

    ``num_pages`` counts usable KV pages per rank (the null page comes on top). Every rank of
    the replica gets the same config, so every rank's scheduler makes the same decisions.
    ``page_layout`` and ``arrangement`` accept their enum's string values too. The simulator's
    ``tspd_sim.cluster.EngineTuning`` spells the settings it shares the same way.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    #: A safetensors checkpoint directory or a GGUF file; ``None`` = seeded random weights.
    checkpoint: Path | None = None
    seed: int = 0
    tp: int = 1
    page_size: int = 16
    num_pages: int = 1024
    #: Most requests admitted at once (decode batch rows).
    max_running: int = 64
    #: Prompt tokens one round may prefill (longer prompts are chunked).
    max_prefill_tokens: int = 2048
    #: Longest prompt + output, in tokens; defaults to the model's max positions.
    max_model_len: int | None = None
    prefix_cache: bool = True
    #: KV page order: NHD (token-major: what TokenSpeed peers have, so the default) or HND
    #: (head-major: tspd only; faster re-slicing between unequal TP, docs/layout.md).
    page_layout: PageLayout = PageLayout.NHD
    #: Arena planes: PER_FIELD (one plane per layer's K or V) or PAGE_MAJOR.
    arrangement: PlaneArrangement = PlaneArrangement.PER_FIELD
    #: Launch decode step N+1 before reading step N (the device token feed).
    device_feed: bool = True
    device: str = "cpu"
    #: torch intra-op threads per rank (0 = leave torch's default). One by default: the
    #: reference model's matmuls are small, and OpenMP workers spinning on a shared or
    #: oversubscribed CPU cost far more than they gain (measured: 26 µs vs 11 ms per matmul).
    threads: int = 1
    #: CPU ranks run under Linux's SCHED_BATCH (threads started after the switch inherit it):
    #: the forward is throughput work, so a transfer worker or Mooncake thread that wakes on a
    #: shared core runs at once instead of after the forward's time slice (docs/engine.md,
    #: "Scheduling policy"). Ranks on a GPU keep the normal policy (their thread launches
    #: kernels and must not wait).
    batch_sched: bool = True
    #: Seconds a rank waits on a collective before declaring the group dead.
    group_timeout_s: float = 60.0
    #: Where rank 0 appends one CSV line per round that ran a forward (its shape and
    #: duration: ``rank/steps.py``; ``tspd-sim calibrate`` reads it); None = no log.
    step_log: Path | None = None

    def __post_init__(self) -> None:
        # The flags and older call sites pass the enums' string values.
        layout = _member(PageLayout, self.page_layout, "page_layout")
        object.__setattr__(self, "page_layout", layout)
        planes = _member(PlaneArrangement, self.arrangement, "arrangement")
        object.__setattr__(self, "arrangement", planes)
        checks = {
            "tp": self.tp >= 1,
            "page_size": self.page_size >= 1,
            "num_pages": self.num_pages >= 1,
            "max_running": self.max_running >= 1,
            "max_prefill_tokens": self.max_prefill_tokens >= 1,
            "threads": self.threads >= 0,
            "group_timeout_s": self.group_timeout_s > 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(f"{name} out of range: {getattr(self, name)!r}")
        # A checkpoint's own positions are checked when it is read (model.build.resolve_model).
        if self.checkpoint is None and self.context_limit > self.model.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {self.context_limit} exceeds the model's "
                f"max_position_embeddings {self.model.max_position_embeddings}"
            )
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    @property
    def context_limit(self) -> int:
        """Longest sequence (prompt + generated) a request may reach (with a checkpoint and no
        ``max_model_len``: see ``model.build.resolve_model`` for the model's own)."""
        return self.max_model_len or self.model.max_position_embeddings

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


_E = TypeVar("_E", PageLayout, PlaneArrangement)


def _member(enum: type[_E], value: str, name: str) -> _E:
    """``value`` (of field ``name``) as a member of ``enum``: a member, or its string value."""
    try:
        return enum(value)
    except ValueError:
        names = " or ".join(repr(m.value) for m in enum)
        raise ConfigError(f"{name} must be {names}, got {value!r}") from None
