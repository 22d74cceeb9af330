"""A replica's step log and step-time counters: what each scheduler round computed, and how
long it took.

Rank 0 of a replica times every round that ran a forward — from the moment its intake was
collected to the moment its outputs were sent, so the broadcast, the PD poll, the scheduler
and the forward all count, as they do in the time a request waits for its next token — and

* adds it to the counters ``{prefill,decode,mixed}_rounds`` and ``..._round_seconds`` (the
  node's ``/stats`` and ``/metrics``: ``tspd_node_decode_round_seconds_total`` / ``_rounds_total``
  is the mean decode step), by what the round ran: prefill chunks only, a decode step only,
  or both;
* with a log path (``--step-log``), appends one CSV line (:data:`COLUMNS`) per such round, the
  header first when the file is empty. ``tspd-sim calibrate`` fits its step-time model on
  these lines (docs/simulator.md, "Calibrating against a real node").

A round that ran no forward (waiting on a PD peer, idle polls) is neither logged nor counted.

Threading: rank 0's engine thread only.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TextIO

from tspd_engine.loop.runner import RoundShape
from tspd_serving.errors import ConfigError

#: The step log's columns: wall-clock end of the round (Unix seconds), its duration, the
#: replica's TP, then what its forwards computed (see :class:`RoundShape`).
COLUMNS = (
    "end_s", "seconds", "tp", "prefill_seqs", "prefill_tokens", "prefill_ctx", "prefill_pairs",
    "decode_batch", "decode_ctx",
)  # fmt: skip
KINDS = ("prefill", "decode", "mixed")


def replica_log(path: Path, replica: int, replicas: int) -> Path:
    """The log of one replica: ``path`` itself for a node of one replica, else
    ``<stem>.r<replica><suffix>`` beside it (each replica's rank 0 writes its own file)."""
    if replicas == 1:
        return path
    return path.with_name(f"{path.stem}.r{replica}{path.suffix}")


def check_writable(path: Path) -> None:
    """:class:`ConfigError` unless ``path`` can be appended to (before any rank starts)."""
    try:
        with path.open("a"):
            pass
    except OSError as exc:
        raise ConfigError(f"--step-log {path}: cannot write it ({exc.strerror})") from exc


class StepLog:
    """Rank 0's round timings: counters always, CSV lines when ``path`` is given."""

    def __init__(self, tp: int, path: Path | None = None) -> None:
        self.tp = tp
        self.rounds = dict.fromkeys(KINDS, 0)
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self._file: TextIO | None = None
        if path is not None:
            self._file = path.open("a", buffering=1)  # one line per write reaches the file
            if self._file.tell() == 0:
                self._file.write(",".join(COLUMNS) + "\n")

    def record(self, shape: RoundShape, seconds: float) -> None:
        """Count (and log) one round; a round without a forward is skipped."""
        if shape.empty:
            return
        kind = "mixed" if shape.prefill_seqs and shape.decode_batch else (
            "prefill" if shape.prefill_seqs else "decode")  # fmt: skip
        self.rounds[kind] += 1
        self.seconds[kind] += seconds
        if self._file is not None:
            row = (
                f"{time.time():.6f},{seconds:.6f},{self.tp},{shape.prefill_seqs},"
                f"{shape.prefill_tokens},{shape.prefill_ctx},{shape.prefill_pairs},"
                f"{shape.decode_batch},{shape.decode_ctx}\n"
            )
            self._file.write(row)

    def stats(self) -> dict[str, float]:
        """The counters, under the keys the node's ``/stats`` and ``/metrics`` use."""
        out: dict[str, float] = {}
        for kind in KINDS:
            out[f"{kind}_rounds"] = self.rounds[kind]
            out[f"{kind}_round_seconds"] = self.seconds[kind]
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
