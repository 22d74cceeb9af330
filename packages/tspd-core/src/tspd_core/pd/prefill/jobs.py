"""Where routes become writes: one chunk of a room, planned into a write job per D destination.

Both ways a P rank sends KV go through :class:`JobBuilder`: the plain path (a chunk handed over
after its forward: one job per destination, :mod:`tspd_core.pd.prefill.rooms`) and the layerwise
path (a chunk armed before its forward: one job per destination per interval of layers,
:mod:`tspd_core.pd.prefill.layerwise`)::

    P's block table ──┐  source_manifest          ┌─ direct: descriptors into D's pages
    D's manifest ─────┼─ chunk_positions ─► Target ┤  plan_runs(route, p, d, layers=...)
    (one destination) │  (first chunk: + P's hit) │       └─► WriteJob ─► transfer/pool.py
                      └───────────────────────────┘  staged: the same WriteJob + a StagedJob
                                                      (many small runs, and D granted slots)

Offsets in a job are relative to the two arena bases (P's mapping in this worker, D's
registered base). Control thread only; the jobs' ``done`` callbacks run on transfer threads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tspd_core.layout import BlockManifest, CacheContract, chunk_positions
from tspd_core.layout.strided import plan_runs
from tspd_core.pd.config import PdTunables
from tspd_core.pd.errors import TransferError
from tspd_core.pd.prefill.state import Destination, PRoom, source_manifest
from tspd_core.pd.proc.control import ControlPlane
from tspd_core.pd.transfer.pool import INLINE_DESCRIPTORS, WriteJob
from tspd_core.pd.transfer.staging import StagedJob, StagingLink
from tspd_core.pd.wire import ipc
from tspd_core.pd.wire.frames import Registration, ScatterRequest, encode_scatter

#: A job of at most this many runs is staged by ``stage_few_below_bytes`` (the descriptors an
#: inline direct job may have).
FEW_RUNS = INLINE_DESCRIPTORS

#: ``done(job, error)`` on the transfer thread that ran the job (it must only post).
Done = Callable[[WriteJob, TransferError | None], None]


@dataclass(frozen=True, slots=True, eq=False)
class Target:
    """One real destination of a chunk: where D's pages are and what P reads for them."""

    session: str
    dest: Destination
    dst: BlockManifest  #: D's manifest (a dummy rendezvous has none and is no target)
    src: BlockManifest  #: P's pages for D's window, from the chunk's block tables
    positions: dict[str, tuple[int, int]]  #: the manifest positions this chunk makes ready


class JobBuilder:
    """Plans a room's chunk into :class:`WriteJob` s (see the module docstring).

    ``links`` is the live map of D sessions to their staging grants (a session without one is
    written directly); ``control`` sends a staged job's scatter requests to its D rank.
    """

    def __init__(
        self,
        contract: CacheContract,
        p_rank: int,
        base_ptr: int,
        tunables: PdTunables,
        links: Mapping[str, StagingLink],
        control: ControlPlane,
    ) -> None:
        self.contract = contract
        self.p_rank = p_rank
        self.base_ptr = base_ptr
        self.tunables = tunables
        self.links = links
        self.control = control

    def targets(self, room: PRoom, chunk: ipc.SubmitChunk | ipc.ArmChunk) -> list[Target]:
        """The chunk's real destinations, in pre-allocation order (a dummy D session only
        rendezvouses: nothing to write). The room's first chunk also covers P's prefix hit,
        so call this before counting the chunk in ``room.chunks``."""
        out = []
        for sid, dest in room.dests.items():
            if dest.manifest is None:
                continue
            src = source_manifest(self.contract, chunk.block_ids, dest.manifest)
            positions = chunk_positions(
                self.contract, dest.manifest, chunk.start, chunk.end, first=room.chunks == 0
            )
            out.append(Target(sid, dest, dest.manifest, src, positions))
        return out

    def job(
        self, room: PRoom, target: Target, done: Done, layers: tuple[int, int] | None = None
    ) -> WriteJob | None:
        """The write of ``target``'s copies (of merged layers ``layers`` only, if given), or
        None when there is nothing to copy."""
        reg = target.dest.session.reg
        runs = plan_runs(
            target.dest.session.route,
            self.p_rank,
            reg.tp_rank,
            target.src,
            target.dst,
            layers=layers,
            positions=target.positions,
        )
        if not len(runs):
            return None
        # Both ways of writing take single descriptors (Mooncake's batches, and the staged
        # piece's scatter request), so the runs are expanded here, once: planning NHD
        # re-slicing as runs and expanding them costs less than building the descriptors
        # one per token row (docs/layout.md, "Strided runs").
        copies = runs.expand()
        staging = self._staging(target.session, reg, len(copies), copies.nbytes)
        return WriteJob(
            room.room,
            target.session,
            copies.src,
            copies.dst,
            copies.length,
            self.base_ptr,
            reg.base_ptr,
            done,
            room.cancel,
            staging,
        )

    def jobs(self, room: PRoom, chunk: ipc.SubmitChunk, done: Done) -> list[WriteJob]:
        """The plain path: the whole chunk, one job per destination with copies."""
        planned = (self.job(room, t, done) for t in self.targets(room, chunk))
        return [job for job in planned if job is not None]

    def _staging(self, sid: str, reg: Registration, runs: int, nbytes: int) -> StagedJob | None:
        """Stage when D granted slots and there are many runs, small on average (a job of
        few runs only when they are shorter still: PdTunables.stage_few_below_bytes)."""
        link, t = self.links.get(sid), self.tunables
        below = t.stage_below_bytes
        if runs <= FEW_RUNS:
            below = min(below, t.stage_few_below_bytes)
        if link is None or runs < t.stage_min_runs or nbytes >= runs * below:
            return None

        def send(req: ScatterRequest) -> None:
            self.control.send(reg.endpoint, reg.port, encode_scatter(req))

        return StagedJob(link, send)
