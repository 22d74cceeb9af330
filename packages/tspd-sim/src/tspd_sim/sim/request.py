"""One simulated request's timeline and accounting (mutable; owned by the simulation loop).

Times are simulated seconds; NaN until the event happens. The life of a request::

    arrival ─▶ D admission queue ─(pages on D)─▶ P queue ─▶ prefill chunks ─▶ KV transfer
            ─▶ first token at D ─▶ decode steps (batched) ─▶ finish

TTFT is measured at the client: arrival → the first token leaves the cluster. By default
(``EngineTuning.early_first_token``, as tspd's router) that is P's prefill end: the router
passes the token in P's answer on at once, so TTFT is D admission, the P queue and the
prefill. Without it (a router holding the first token for D's) the token leaves D: with
``EngineTuning.decode_rounds`` (the default) with the end of the request's first decode
step, as an engine loop that works in rounds sends it (:mod:`tspd_sim.sim.decode`); without
rounds as the KV lands (P's Success message carries it), which adds the transfer time not
hidden behind the prefill by layerwise streaming.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

NAN = float("nan")


class SimRequest:
    """Per-request state. Engines write only the fields of their own phase."""

    __slots__ = (
        "arrival",
        "chunks",
        "computed",
        "ctx",
        "d_engine",
        "d_hit",
        "gaps",
        "idx",
        "input_len",
        "join_step",
        "key_list",
        "keys",
        "output_len",
        "p_engine",
        "p_hit",
        "preemptions",
        "progress",
        "recomputed",
        "reject",
        "rid",
        "room",
        "seg_start",
        "segments",
        "steps_left",
        "swap_bytes",
        "t_d_admit",
        "t_finish",
        "t_first_step",
        "t_first_token",
        "t_kv",
        "t_last_token",
        "t_prefill_end",
        "t_prefill_start",
        "t_xfer_start",
        "xfer_bytes",
        "xfer_desc",
    )

    def __init__(
        self,
        idx: int,
        room: int,
        arrival: float,
        input_len: int,
        output_len: int,
        keys: npt.NDArray[np.uint64],
    ) -> None:
        self.idx, self.room, self.arrival = idx, room, arrival
        self.rid = f"r{idx}"
        self.input_len, self.output_len, self.keys = input_len, output_len, keys
        #: The page keys as Python ints (for cheap ``key in store`` probes while routing).
        self.key_list: list[int] = keys.tolist()
        self.p_engine = -1
        self.d_engine = -1
        self.p_hit = 0  #: prompt tokens served by P's prefix store
        self.d_hit = 0  #: prompt tokens already on D (D's prefix store): not transferred
        self.progress = 0  #: prompt tokens whose KV exists on P (hit + computed so far)
        self.computed = 0  #: prompt tokens P computed (input_len − p_hit when done)
        self.chunks = 0
        self.ctx = 0  #: attention context of the request's next decode step
        self.steps_left = 0  #: decode steps still to run (output_len − 1 at the start)
        self.join_step = -1  #: index of its first decode step in its D engine's step log
        #: Step index where its current run of decode steps began (-1: not running a step yet
        #: since it joined or was brought back after a preemption).
        self.seg_start = -1
        self.preemptions = 0
        self.recomputed = 0  #: tokens D prefilled again after preemptions (recompute)
        self.swap_bytes = 0  #: KV bytes copied to and from host memory (swap), all ranks
        #: Its runs of decode steps, (first step, steps), once preempted (None before: one run
        #: from join_step); and the gap between each run's last token and the next run's first.
        self.segments: list[tuple[int, int]] | None = None
        self.gaps: list[float] | None = None
        self.xfer_bytes = 0
        self.xfer_desc = 0
        self.reject = ""
        self.t_d_admit = NAN
        self.t_prefill_start = NAN
        self.t_prefill_end = NAN
        self.t_xfer_start = NAN
        self.t_kv = NAN  #: its KV (and P's first token) landed on D
        #: The first token left P (early_first_token), or D (= t_kv unless decode_rounds)
        self.t_first_token = NAN
        self.t_first_step = NAN  #: end of its first decode step (its second token)
        self.t_last_token = NAN  #: its latest token when preempted (the end of a run)
        self.t_finish = NAN
