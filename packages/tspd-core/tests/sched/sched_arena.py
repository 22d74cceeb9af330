"""A paged token arena and a decode backend over it (test double for the engine's model).

The arena stores, at (page, offset), the token whose KV the engine would keep there. The
backend "model" derives the next token from every earlier token *read back through the page
table*, so a wrong page id, a missing copy-on-write or a lost write changes the tokens. Every
write asserts the page is private (reference count 1): a shared page is never written.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tspd_core.sched import BlockPool, DecodeOutputs, DecodeRound

VOCAB = 997


def next_token(tokens: Sequence[int]) -> int:
    """The reference model: a rolling hash of the whole sequence."""
    acc = 7
    for t in tokens:
        acc = (acc * 31 + int(t) + 1) % VOCAB
    return acc


class Arena:
    """Token-per-slot stand-in for a KV arena of ``pool``'s pages."""

    def __init__(self, pool: BlockPool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        self.kv = np.full((pool.num_pages + 1, page_size), -1, dtype=np.int64)
        self.writes = 0

    def write(self, page: int, offset: int, token: int) -> None:
        assert page != 0, "write into the null page"
        rc = self.pool.refcount(page)
        assert rc == 1, f"write into page {page} shared by {rc} holders without a copy"
        self.kv[page, offset] = token
        self.writes += 1

    def copy(self, src: int, dst: int) -> None:
        self.kv[dst] = self.kv[src]

    def write_tokens(self, table: np.ndarray, tokens: Sequence[int], start: int) -> None:
        """Prefill: write tokens[start:] at their positions through ``table``."""
        for pos in range(start, len(tokens)):
            self.write(int(table[pos // self.page_size]), pos % self.page_size, tokens[pos])

    def read(self, table: np.ndarray, length: int) -> list[int]:
        ps = self.page_size
        return [int(self.kv[table[p // ps], p % ps]) for p in range(length)]


class ArenaBackend(Arena):
    """Decode backend over the arena, with a device-feed emulation for pipelined rounds."""

    def __init__(self, pool: BlockPool, page_size: int) -> None:
        super().__init__(pool, page_size)
        self.calls = 0
        self.prev_out = np.zeros(0, dtype=np.int32)  # the "device" outputs of the last step

    def launch(self, batch: DecodeRound) -> np.ndarray:
        """Run one step; return the sampled tokens in item order."""
        for src, dst in batch.copies.tolist():
            self.copy(src, dst)
        items, ps = batch.items, self.page_size
        tokens = np.zeros(batch.size, dtype=np.int32)
        for i in range(batch.size):
            tok = items.token[i] if items.token_on_host[i] else self.prev_out[items.feed_row[i]]
            off, n = int(items.table_offset[i]), int(items.table_len[i])
            table = batch.block_table[off : off + n]
            pos = int(items.position[i])
            self.write(int(table[pos // ps]), pos % ps, int(tok))
            tokens[i] = next_token(self.read(table, pos + 1))
        self.prev_out = tokens
        return tokens

    def execute_ragged(self, batch: DecodeRound, out: DecodeOutputs) -> int:
        self.calls += 1
        tokens = self.launch(batch)
        n = batch.size
        out.slot[:n] = batch.items.slot
        out.serial[:n] = batch.items.serial
        out.token[:n] = tokens
        return n
