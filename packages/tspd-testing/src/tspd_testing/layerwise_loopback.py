"""Layerwise streaming on one host: a simulated P forward over a :class:`LoopbackCluster`.

For tests and the ``layerwise`` benchmark. :class:`SimulatedForward` plays the engine's part: it
arms a forward batch's rows, then for every producer step writes that step's layers of the chunk
into P's arena (each page's identity, :mod:`tspd_testing.identity`), optionally
"computes" for a while, and advances the rank's step counter; after the last step it hands over
the first tokens of the final rows. KV written only as the forward reaches it means a send that
comes too early carries the old bytes, which the identity check on D catches::

    arm_layerwise(rows) ─► step 0: write layer 0 of each chunk, [compute], counter.advance()
                           step 1: ...                                      ...
                           hand_over_remote_decode(first tokens of final rows)

:func:`drive_layerwise` runs many rooms concurrently, each prefilled in chunks starting at
P's own cache hit (:class:`PrefillJob`), one forward batch per P rank per round.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tspd_core.ids import RequestId
from tspd_core.pd.errors import PdError
from tspd_core.pd.events import Bootstrapped, Failed, Succeeded
from tspd_core.pd.layerwise.schedule import ProducerSchedule
from tspd_core.pd.prefill.peer import FirstToken, PrefillOutbox, PrefillPeer, RemoteDecodeRow
from tspd_testing.identity import fill_identity, page_mask
from tspd_testing.loopback import LoopbackCluster, Outcome, Rank, RoomPlan

#: One forward batch of one P rank: (job, index of its chunk) per row.
Batch = Sequence[tuple["PrefillJob", int]]


@dataclass(frozen=True, slots=True, eq=False)
class PrefillJob:
    """How P prefills one room: from its own cache hit ``p_start`` (page-aligned; the pages
    before it are cached on P already), ``chunk`` tokens per forward."""

    plan: RoomPlan
    p_start: int = 0
    chunk: int = 1 << 30

    def chunks(self) -> list[tuple[int, int]]:
        n = self.plan.prompt_len
        return [(cs, min(cs + self.chunk, n)) for cs in range(self.p_start, n, self.chunk)]


def chunked_jobs(
    rooms: Sequence[RoomPlan], granularity: int, chunk: int, seed: int = 0
) -> list[PrefillJob]:
    """A job per room with a random page-aligned P cache hit (below or above D's prefix)."""
    rng = np.random.default_rng(seed)
    jobs = []
    for r in rooms:
        pages = (r.prompt_len - 1) // granularity
        hit = granularity * int(rng.integers(0, pages + 1)) if rng.random() < 0.5 else 0
        jobs.append(PrefillJob(r, hit, chunk))
    return jobs


class SimulatedForward:
    """The engine's forward, per producer step, on every P rank of a cluster in lockstep.

    ``compute_s``: time each producer step "computes" (a sleep: the device's time, during
    which the host and the network are free). ``write``: write each step's layers into P's
    arena as the step finishes (else the caller filled P beforehand).
    """

    def __init__(
        self, cluster: LoopbackCluster, compute_s: float = 0.0, write: bool = True
    ) -> None:
        self.cluster = cluster
        self.compute_s = compute_s
        self.write = write
        peer = cluster.p[0].peer
        assert isinstance(peer, PrefillPeer)
        draft = cluster.layerwise[1]
        self.schedule = ProducerSchedule.for_contract(peer.contract, draft)

    def prefill_cached(self, jobs: Sequence[PrefillJob]) -> None:
        """P's own cache hits: the pages before each job's ``p_start`` hold their identity;
        every other page of the jobs is zero until the forward writes it."""
        for rank in self.cluster.p:
            for job in jobs:
                plan = job.plan
                rank.view.arena[page_mask(rank.view.contract, plan.p_table)] = 0
                fill_identity(rank.view, _slots(rank, plan, 0, job.p_start), salt=plan.room)
            rank.mirror.push()

    def run(
        self,
        batches: Mapping[int, Batch],
        layerwise: bool = True,
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        """One forward on each P rank named in ``batches`` (by index), steps in lockstep.

        ``layerwise=False`` is the baseline: rows are staged and handed over after the
        forward, and the counter does not move.
        """
        ranks = {i: self.cluster.p[i] for i in batches}
        for i, batch in batches.items():
            rows = [_row(ranks[i], job, k) for job, k in batch]
            outbox = _outbox(ranks[i])
            if layerwise:
                outbox.arm_layerwise(rows)
            else:
                outbox.stage_remote_decode(rows)
        for step in range(self.schedule.steps):
            layers = self.schedule.layers(step, step + 1)
            if self.compute_s:
                time.sleep(self.compute_s)
            for i, batch in batches.items():
                if self.write:
                    for job, k in batch:
                        cs, ce = job.chunks()[k]
                        pages = _slots(ranks[i], job.plan, cs, ce)
                        fill_identity(ranks[i].view, pages, job.plan.room, layers)
                    ranks[i].mirror.push()  # on CUDA: the step's KV is on the device first
                if layerwise:
                    _outbox(ranks[i]).step_counter.advance()
            if on_step is not None:
                on_step(step)
        for i, batch in batches.items():
            finals = {
                job.plan.rid: FirstToken(job.plan.token)
                for job, k in batch
                if k == len(job.chunks()) - 1
            }
            _outbox(ranks[i]).hand_over_remote_decode(finals)


def drive_layerwise(
    forward: SimulatedForward, jobs: Sequence[PrefillJob], timeout_s: float = 120.0
) -> Outcome:
    """Run ``jobs`` concurrently to completion on every rank (P chunked, streaming)."""
    cluster = forward.cluster
    by_rid = {j.plan.rid: j for j in jobs}
    plans = {rid: j.plan for rid, j in by_rid.items()}
    ranks = [("p", i, r) for i, r in enumerate(cluster.p)] + [
        ("d", i, r) for i, r in enumerate(cluster.d)
    ]
    out = Outcome(started=time.perf_counter())
    for side, i, _ in ranks:
        out.events[(side, i)] = []
    cluster.register([job.plan for job in jobs], out)
    active: dict[int, dict[RequestId, int]] = {i: {} for i in range(len(cluster.p))}
    deadline = time.monotonic() + timeout_s
    while any(rank.peer.has_in_flight() for _, _, rank in ranks):
        if time.monotonic() > deadline:
            raise PdError(f"rooms still in flight after {timeout_s:g} s: {cluster._stuck()}")
        busy = cluster.publish_zeroed()
        for side, i, rank in ranks:
            events = rank.peer.poll()
            busy |= bool(events)
            out.events[(side, i)].extend(events)
            if side == "d":
                cluster._react(side, rank, events, plans, out)
                continue
            now = time.perf_counter()
            for e in events:
                if isinstance(e, Bootstrapped):
                    active[i][e.rid] = 0
                elif isinstance(e, Succeeded | Failed):
                    active[i].pop(e.rid, None)
                    out.done_at[e.rid] = max(out.done_at.get(e.rid, 0.0), now)
        batches = {i: [(by_rid[rid], k) for rid, k in a.items()] for i, a in active.items() if a}
        if batches:
            forward.run(batches)
            _advance(active, by_rid)
        elif not busy:
            mpc.wait([r.peer.fileno() for _, _, r in ranks], timeout=0.01)
    return out


def _advance(active: dict[int, dict[RequestId, int]], jobs: Mapping[RequestId, PrefillJob]) -> None:
    """Each row moves to its next chunk; a room whose final chunk ran leaves the batch."""
    for rows in active.values():
        for rid in list(rows):
            rows[rid] += 1
            if rows[rid] == len(jobs[rid].chunks()):
                del rows[rid]


def _outbox(rank: Rank) -> PrefillOutbox:
    assert isinstance(rank.outbox, PrefillOutbox)
    return rank.outbox


def _row(rank: Rank, job: PrefillJob, k: int) -> RemoteDecodeRow:
    cs, ce = job.chunks()[k]
    tables = [job.plan.p_table[g] for g in rank.view.contract.group_ids()]
    return RemoteDecodeRow(job.plan.rid, tables, cs, ce, final=ce == job.plan.prompt_len)


def _slots(rank: Rank, plan: RoomPlan, start: int, end: int) -> dict[str, npt.NDArray[np.int64]]:
    """Block-table rows holding only the pages of tokens ``[start, end)`` (others 0 = skip)."""
    out = {}
    for spec in rank.view.contract.group_specs:
        g = spec.block_granularity
        table = plan.p_table[spec.group_id]
        row = np.zeros_like(table)
        lo, hi = start // g, -(-end // g)
        row[lo:hi] = table[lo:hi]
        out[spec.group_id] = row
    return out
