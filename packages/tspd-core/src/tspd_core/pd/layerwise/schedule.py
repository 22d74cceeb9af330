"""Layerwise streaming (wire.md §7): producer steps, intervals, and what the worker is told.

A forward batch writes its KV layer by layer. wire.md §7 numbers the **producer steps** of one
forward: step ``i`` writes the fields of target layer ``i``; draft layers (merged indices after
the target layers), if any, form one extra final step. With interval width ``w`` the steps are
cut into intervals ``[b, e)`` (the last one clipped); the worker sends an interval once the
counter passed ``begin + e − 1``::

    target layers 0..3, one draft layer (merged 4), w = 2
    steps      0     1     2     3     4(draft)
    intervals  [0,       2) [2,       4) [4, 5)
    layers     [0,       2) [2,       4) [4, 5)      (merged-layer intervals for plan_copies)
    target     begin+1      begin+3      begin+4     (the counter must pass these)

The schedule depends only on the contract (how many merged layers it has) and how many of them
are draft layers, so every P rank and the worker compute the same one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tspd_core.layout import CacheContract
from tspd_core.pd.errors import ConfigError
from tspd_core.pd.layerwise.step_counter import wrap


@dataclass(frozen=True, slots=True)
class ProducerSchedule:
    """The producer steps of one forward: ``target_layers`` steps, plus one for the drafts."""

    target_layers: int
    total_layers: int  #: target + draft (merged layer indices 0 .. total_layers − 1)

    def __post_init__(self) -> None:
        if not 1 <= self.target_layers <= self.total_layers:
            raise ConfigError(
                f"{self.total_layers} merged layers cannot hold {self.target_layers} target "
                "layers (draft_layers must be below the contract's layer count)"
            )

    @classmethod
    def for_contract(cls, contract: CacheContract, draft_layers: int = 0) -> ProducerSchedule:
        """The schedule of a rank whose contract holds ``draft_layers`` draft layers last."""
        if draft_layers < 0:
            raise ConfigError(f"draft_layers must be >= 0, got {draft_layers}")
        total = 1 + max(f.layer for f in contract.plan.fields)
        return cls(total - draft_layers, total)

    @property
    def steps(self) -> int:
        """Producer steps per forward: one per target layer, one for all draft layers."""
        return self.target_layers + (self.total_layers > self.target_layers)

    def layers(self, b: int, e: int) -> tuple[int, int]:
        """The merged-layer interval the producer steps ``[b, e)`` write."""
        if not 0 <= b < e <= self.steps:
            raise ValueError(f"steps [{b}, {e}) are outside 0..{self.steps}")
        return b, (e if e <= self.target_layers else self.total_layers)

    def intervals(self, width: int) -> list[tuple[int, int]]:
        """The step intervals of width ``width`` (the last one clipped)."""
        if width < 1:
            raise ValueError(f"an interval is at least one step wide, got {width}")
        return [(b, min(b + width, self.steps)) for b in range(0, self.steps, width)]


def interval_target(begin: int, e: int) -> int:
    """The counter value an interval ending at step ``e`` waits for: ``(begin + e − 1) mod M``."""
    return wrap(begin + e - 1)


@dataclass(frozen=True, slots=True)
class LayerwiseSpec:
    """What a P worker needs to stream layerwise; travels in its ``WorkerSpec``.

    ``counter`` is the :class:`~tspd_core.pd.layerwise.step_counter.StepCounter`'s shared host word
    (one int64, shared memory), handed to the worker process like the arena.
    """

    interval: int  #: producer steps per interval (> 0)
    draft_layers: int
    counter: torch.Tensor = field(compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ConfigError(f"layerwise interval must be >= 1 when on, got {self.interval}")
