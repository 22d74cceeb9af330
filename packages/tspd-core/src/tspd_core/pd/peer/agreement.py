"""Replica agreement: every rank of a replica acts on the same room events in the same round.

Each scheduler round, each rank packs one row per tracked request into a ``uint8`` vector in
request-insertion order (identical on every rank, because every rank admits the same requests
in the same order), reduces it with MIN across the replica, and applies the rules of wire.md §1 to
its local state ``s`` and the reduced row ``v``::

    s = Bootstrapping, v >= 2  -> Bootstrapped; s := Bootstrapped
    v = 0                      -> Failing; s := Failed (no event yet, see below)
    s = Bootstrapped,  v = 5   -> P: Succeeded / D: RemotePrefill; the request is forgotten
    anything else              -> nothing

One event per request per round: a room the engine handed its part of before Bootstrapped
(D: the manifest with the registration; P: a prefill that ran before D's pre-allocations
arrived, see docs/pd.md) may report WaitingForInput or even Success before the engine acted
on Bootstrapped; it gets Bootstrapped in this round and its final event in the next.

Failed, in two phases. A failure on any rank fails the room on every rank in the same round
(``v = 0``), but the Failed *event* — on which the engine frees the request's pages — waits
until no write of the room can still land in (D) or read from (P) any rank of the replica:
while ``s = Failed`` a rank's row says ``[quiet, not settled]`` instead of ``[state, 1]``, where
*quiet* means this rank's worker has no write of the room in flight (P: drained; D: every P
rank it expects answered, or the manifest never went out, or a timeout gave up) and *settled*
(D only) means a P rank pushed Failed — which a tspd P does only once every rank of its
replica drained the room. The Failed event fires, once, when every rank is quiet (``v[0] = 1``)
or some rank is settled (``v[1] = 0``). So a rank whose own transfer is fine still never frees
pages another rank's transfer may touch.

A replica of one (:class:`SoloMesh`) takes the same path with an identity reduction;
:class:`GlooMesh` reduces over a torch.distributed gloo group of the replica's ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Protocol

import numpy as np
import numpy.typing as npt

from tspd_core.pd.status import TransferPoll

States = npt.NDArray[np.uint8]


class ReplicaGroup(Protocol):
    """The ranks of one replica. ``min_reduce`` is collective: every member calls it with a
    vector of the same length in the same round, and all get the same element-wise MIN."""

    def min_reduce(self, states: States) -> States: ...


class Mesh(Protocol):
    """Where a rank finds the group of a replica it belongs to."""

    def replica_group(self, replica: int) -> ReplicaGroup: ...


class _Solo:
    def min_reduce(self, states: States) -> States:
        return states


class SoloMesh:
    """Every replica is this rank alone: the reduction is the identity."""

    def replica_group(self, replica: int) -> ReplicaGroup:
        return _Solo()


SOLO = SoloMesh()


class _GlooGroup:
    def __init__(self, group: object) -> None:
        self._group = group

    def min_reduce(self, states: States) -> States:
        import torch
        import torch.distributed as dist

        if states.size == 0:
            return states  # every member has the same (empty) vector: nothing to agree on
        tensor = torch.from_numpy(states.copy())
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._group)
        out: States = tensor.numpy()
        return out


class GlooMesh:
    """Replica groups backed by torch.distributed gloo groups (``replica index -> group``)."""

    def __init__(self, groups: Sequence[object]) -> None:
        self._groups = [_GlooGroup(g) for g in groups]

    def replica_group(self, replica: int) -> ReplicaGroup:
        return self._groups[replica]


class Verdict(Enum):
    """What one round decides for one request."""

    NONE = "none"
    BOOTSTRAPPED = "bootstrapped"
    SUCCEEDED = "succeeded"
    FAILING = "failing"  #: the replica failed it; the event waits for every rank to be quiet
    FAILED = "failed"


def pack(states: Sequence[TransferPoll]) -> States:
    """Local states as a vector (one byte per request)."""
    return np.fromiter((int(s) for s in states), dtype=np.uint8, count=len(states))


def row(local: TransferPoll, latest: TransferPoll, quiet: bool, settled: bool) -> tuple[int, int]:
    """One request's row: ``[state, 1]`` until the replica failed it, then ``[quiet, ¬settled]``."""
    if local is TransferPoll.FAILED:
        return int(quiet), int(not settled)
    return int(latest), 1


def pack_rows(rows: Sequence[tuple[int, int]]) -> States:
    """Rows as the flat vector the replica reduces (two bytes per request)."""
    return np.asarray(rows, dtype=np.uint8).reshape(-1)


def decide(local: TransferPoll, reduced: int, settled: int = 1) -> Verdict:
    """wire.md §1's rules for one request: ``local`` is the engine's state, ``(reduced,
    settled)`` the reduced row (see the module docstring)."""
    if local is TransferPoll.FAILED:
        return Verdict.FAILED if reduced == 1 or settled == 0 else Verdict.NONE
    if reduced == TransferPoll.FAILED:
        return Verdict.FAILING
    if local is TransferPoll.BOOTSTRAPPING and reduced >= TransferPoll.BOOTSTRAPPED:
        return Verdict.BOOTSTRAPPED
    if local is TransferPoll.BOOTSTRAPPED and reduced == TransferPoll.SUCCESS:
        return Verdict.SUCCEEDED
    return Verdict.NONE
