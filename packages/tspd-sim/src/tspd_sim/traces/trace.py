"""The in-memory request trace: columnar numpy arrays, immutable, cheap to slice and rescale.

A trace is what the simulator replays: for request i, its arrival time, prompt length, output
length and (when the source has them) its prefix block identities. Prefix identities follow the
Mooncake trace's convention: ``hash_ids`` name consecutive ``block_tokens``-token blocks of the
prompt, and an id is a *chained* identity — two requests that share an id at position j share
the whole prompt up to the end of block j. The simulator derives per-page prefix keys from them.

The ragged ``hash_ids`` lists are stored CSR-style (``hash_offsets`` of length n + 1 into one
flat ``hash_ids`` array) so a 12k-request trace is four numpy arrays, not 12k Python lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from tspd_sim.errors import TraceError

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

#: Tokens per prefix block in the Mooncake traces (their ``hash_ids`` granularity).
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True, eq=False)
class Trace:
    """A replayable request trace (arrays are read-only; every transform returns a new trace).

    Invariants (checked at construction): arrivals are finite, non-negative and sorted; prompt
    and output lengths are ≥ 1; ``hash_offsets`` is non-decreasing with n + 1 entries and request
    i has at most ``ceil(input_len[i] / block_tokens)`` hash ids.
    """

    name: str
    arrival_s: F64
    input_len: I64
    output_len: I64
    hash_offsets: I64 = field(repr=False)
    hash_ids: I64 = field(repr=False)
    #: Tokens per prefix block (0 when the trace carries no prefix identities).
    block_tokens: int = 0

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        for name in ("input_len", "output_len"):
            if len(getattr(self, name)) != n:
                raise TraceError(
                    f"trace {self.name!r}: {name} has {len(getattr(self, name))} "
                    f"entries for {n} arrivals"
                )
        _check_trace(self, n)
        for arr in (
            self.arrival_s,
            self.input_len,
            self.output_len,
            self.hash_offsets,
            self.hash_ids,
        ):
            arr.flags.writeable = False

    # ---- basic facts -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def has_prefixes(self) -> bool:
        """Whether the trace carries prefix identities (Mooncake ``hash_ids``)."""
        return self.block_tokens > 0 and len(self.hash_ids) > 0

    @property
    def duration_s(self) -> float:
        """Time from the first to the last arrival (0 for fewer than two requests)."""
        return float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) > 1 else 0.0

    @property
    def rate(self) -> float:
        """Mean arrival rate in requests per second (0 when it cannot be measured)."""
        return (len(self) - 1) / self.duration_s if self.duration_s > 0 else 0.0

    def hashes(self, i: int) -> I64:
        """The prefix block identities of request i (a read-only view, possibly empty)."""
        return self.hash_ids[self.hash_offsets[i] : self.hash_offsets[i + 1]]

    def describe(self) -> dict[str, float]:
        """Summary numbers for tables and sanity checks."""
        inp, out = self.input_len, self.output_len
        refs = len(self.hash_ids)
        repeat = 1.0 - len(np.unique(self.hash_ids)) / refs if refs else 0.0
        return {
            "requests": float(len(self)),
            "duration_s": self.duration_s,
            "rate_rps": self.rate,
            "input_mean": float(inp.mean()) if len(self) else 0.0,
            "input_median": float(np.median(inp)) if len(self) else 0.0,
            "input_max": float(inp.max()) if len(self) else 0.0,
            "output_mean": float(out.mean()) if len(self) else 0.0,
            "output_total": float(out.sum()),
            "prefix_block_repeat_frac": repeat,
        }

    # ---- transforms --------------------------------------------------------------------------

    def select(self, idx: I64 | npt.NDArray[np.bool_], name: str | None = None) -> Trace:
        """The sub-trace of the given requests (indices or a mask), order preserved."""
        idx = np.flatnonzero(idx) if idx.dtype == np.bool_ else np.sort(idx.astype(np.int64))
        offsets, flat = gather_rows(self.hash_offsets, self.hash_ids, idx)
        return Trace(
            name or self.name,
            self.arrival_s[idx].copy(),
            self.input_len[idx].copy(),
            self.output_len[idx].copy(),
            offsets,
            flat,
            self.block_tokens,
        )

    def head(self, n: int) -> Trace:
        """The first n requests."""
        if n < 0:
            raise TraceError(f"head({n}): the request count must be ≥ 0")
        return self.select(np.arange(min(n, len(self)), dtype=np.int64))

    def window(self, start_s: float, end_s: float) -> Trace:
        """Requests arriving in [start_s, end_s), re-based so the first window instant is 0."""
        if not end_s > start_s:
            raise TraceError(f"window({start_s}, {end_s}): the end must be after the start")
        mask = (self.arrival_s >= start_s) & (self.arrival_s < end_s)
        sub = self.select(mask)
        return sub.retime(sub.arrival_s - start_s)

    def scale_rate(self, factor: float) -> Trace:
        """The same requests arriving ``factor`` times faster (timestamps divided by factor)."""
        if not (np.isfinite(factor) and factor > 0):
            raise TraceError(f"scale_rate({factor}): the factor must be a positive number")
        return self.retime(self.arrival_s / factor, f"{self.name}@x{factor:g}")

    def scale_time(self, factor: float) -> Trace:
        """Stretch the timeline by ``factor`` (> 1 slows arrivals down); inverse of scale_rate."""
        if not (np.isfinite(factor) and factor > 0):
            raise TraceError(f"scale_time({factor}): the factor must be a positive number")
        return self.retime(self.arrival_s * factor)

    def retime(self, arrival_s: F64, name: str | None = None) -> Trace:
        """The same requests with new (sorted) arrival times."""
        return Trace(
            name or self.name,
            np.asarray(arrival_s, dtype=np.float64).copy(),
            self.input_len,
            self.output_len,
            self.hash_offsets,
            self.hash_ids,
            self.block_tokens,
        )

    def clip_lengths(self, max_input: int | None = None, max_output: int | None = None) -> Trace:
        """Cap prompt and output lengths (hash ids beyond the capped prompt are dropped)."""
        inp = self.input_len if max_input is None else np.minimum(self.input_len, max_input)
        out = self.output_len if max_output is None else np.minimum(self.output_len, max_output)
        if self.block_tokens == 0 or max_input is None:
            return Trace(
                self.name,
                self.arrival_s,
                inp.copy(),
                out.copy(),
                self.hash_offsets,
                self.hash_ids,
                self.block_tokens,
            )
        keep = np.minimum(np.diff(self.hash_offsets), -(-inp // self.block_tokens))
        rebased = self.hash_offsets[:-1]
        mask = np.zeros(len(self.hash_ids), dtype=bool)
        owner = np.repeat(np.arange(len(self)), np.diff(self.hash_offsets))
        mask[np.arange(len(self.hash_ids)) - rebased[owner] < keep[owner]] = True
        offsets = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(keep, out=offsets[1:])
        return Trace(
            self.name,
            self.arrival_s,
            inp.copy(),
            out.copy(),
            offsets,
            self.hash_ids[mask].copy(),
            self.block_tokens,
        )

    def scale_lengths(self, input_factor: float = 1.0, output_factor: float = 1.0) -> Trace:
        """Prompt and output lengths times the factors, rounded, at least 1 — the trace's shape
        on a model too slow for its lengths. Prefix identities name blocks of the original
        prompts, so a scaled trace carries none (unless the prompts keep their length)."""
        for name, f in (("input", input_factor), ("output", output_factor)):
            if not (np.isfinite(f) and f > 0):
                raise TraceError(f"{name} length factor {f}: must be a finite number > 0")
        inp = np.maximum(np.rint(self.input_len * input_factor).astype(np.int64), 1)
        out = np.maximum(np.rint(self.output_len * output_factor).astype(np.int64), 1)
        if input_factor == 1.0:
            offsets, ids, block = self.hash_offsets, self.hash_ids, self.block_tokens
        else:
            offsets, ids, block = np.zeros(len(self) + 1, dtype=np.int64), _NO_IDS, 0
        return Trace(self.name, self.arrival_s, inp, out, offsets, ids, block)


_NO_IDS = np.zeros(0, dtype=np.int64)


def gather_rows(offsets: I64, flat: I64, idx: I64) -> tuple[I64, I64]:
    """Rows ``idx`` of a CSR ragged array, as a new (offsets, flat) pair, without a Python loop."""
    starts = offsets[idx]
    counts = offsets[idx + 1] - starts
    new_offsets = np.zeros(len(idx) + 1, dtype=np.int64)
    np.cumsum(counts, out=new_offsets[1:])
    # For each output slot: its source = its row's start + its rank inside the row.
    owner = np.repeat(np.arange(len(idx)), counts)
    rank = np.arange(new_offsets[-1], dtype=np.int64) - new_offsets[owner]
    return new_offsets, flat[starts[owner] + rank].astype(np.int64, copy=True)


def _check_trace(t: Trace, n: int) -> None:
    a = t.arrival_s
    if n and not np.all(np.isfinite(a)):
        raise TraceError(f"trace {t.name!r}: arrival times must be finite")
    if n and a[0] < 0:
        raise TraceError(f"trace {t.name!r}: arrival times must be ≥ 0 (first is {a[0]})")
    if n > 1 and np.any(np.diff(a) < 0):
        raise TraceError(f"trace {t.name!r}: arrival times must be sorted")
    for name in ("input_len", "output_len"):
        arr = getattr(t, name)
        if n and arr.min() < 1:
            bad = int(np.argmin(arr))
            raise TraceError(f"trace {t.name!r}: request {bad} has {name} {arr[bad]}; need ≥ 1")
    off = t.hash_offsets
    if len(off) != n + 1 or off[0] != 0 or off[-1] != len(t.hash_ids) or np.any(np.diff(off) < 0):
        raise TraceError(f"trace {t.name!r}: hash_offsets must be a CSR index of n + 1 entries")
    if len(t.hash_ids) and t.block_tokens <= 0:
        raise TraceError(f"trace {t.name!r}: hash ids need a positive block_tokens")
    if len(t.hash_ids):
        over = np.diff(off) > -(-t.input_len // t.block_tokens)
        if np.any(over):
            bad = int(np.argmax(over))
            raise TraceError(
                f"trace {t.name!r}: request {bad} has {np.diff(off)[bad]} hash ids "
                f"for {t.input_len[bad]} prompt tokens of {t.block_tokens}-token blocks"
            )
