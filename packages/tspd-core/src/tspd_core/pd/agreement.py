"""Replica agreement: every rank of a replica acts on the same room events in the same round.

Each scheduler round, each rank packs the states of its tracked requests into a ``uint8``
vector in request-insertion order (identical on every rank, because every rank admits the same
requests in the same order), reduces it with MIN across the replica, and applies the rules of
WIRE §1 to its local state ``s`` and the reduced value ``v``:

    s = Bootstrapping, v = 2   -> Bootstrapped; s := Bootstrapped
    v = 0                      -> Failed (fires once; the request is forgotten)
    s = Bootstrapped,  v = 5   -> P: Succeeded / D: RemotePrefill; the request is forgotten
    anything else              -> nothing (exact match: a jump past 2 waits for the next round)

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
    FAILED = "failed"


def pack(states: Sequence[TransferPoll]) -> States:
    """Local states as the vector the replica reduces."""
    return np.fromiter((int(s) for s in states), dtype=np.uint8, count=len(states))


def decide(local: TransferPoll, reduced: int) -> Verdict:
    """WIRE §1's rules for one request: ``local`` is the engine's state, ``reduced`` the MIN."""
    if reduced == TransferPoll.FAILED:
        return Verdict.FAILED
    if local is TransferPoll.BOOTSTRAPPING and reduced == TransferPoll.BOOTSTRAPPED:
        return Verdict.BOOTSTRAPPED
    if local is TransferPoll.BOOTSTRAPPED and reduced == TransferPoll.SUCCESS:
        return Verdict.SUCCEEDED
    return Verdict.NONE
