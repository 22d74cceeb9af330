"""A vision tower stand-in for tests, benchmarks and demos: deterministic real torch tensors.

An item's rows come from gathers in fixed random tables, indexed by the item's room and row
number. A gather does no arithmetic, so the bytes are identical in every process and on any
thread count: the prefill side can recompute exactly what the encode side sent and compare
byte for byte. Rows of one item are all different (``n_tokens`` < the table size), and items
of different rooms start at different table rows, so a shifted, swapped or misplaced row shows.
"""

from __future__ import annotations

import torch

from tspd_core.epd.items import EmbeddingChunk
from tspd_core.ids import Room

VOCAB = 4099  # prime, so (room * STRIDE + row) % VOCAB cycles through every table row
STRIDE = 7919


class ToyVisionTower(torch.nn.Module):
    """``encode(room, n_tokens)`` -> ``[n_tokens, hidden]`` rows (and deepstack rows)."""

    def __init__(
        self,
        hidden: int,
        deepstack_levels: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
    ) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        table = torch.randn(VOCAB, hidden * (1 + deepstack_levels), generator=g).to(dtype)
        self.table: torch.Tensor
        self.register_buffer("table", table)
        self.hidden = hidden
        self.deepstack_levels = deepstack_levels

    def forward(self, room: int, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = (torch.arange(n_tokens, dtype=torch.int64) + room * STRIDE) % VOCAB
        rows: torch.Tensor = self.table[ids]
        main = rows[:, : self.hidden].contiguous()
        deep = rows[:, self.hidden :].contiguous() if self.deepstack_levels else None
        return main, deep

    def chunk(self, room: Room, n_tokens: int) -> EmbeddingChunk:
        """The item's rows as the chunk an encode rank sends."""
        main, deep = self(room, n_tokens)
        return EmbeddingChunk(room, main, deep)
