"""What the scheduler side hands the worker side each step (inside vLLM's connector metadata,
pickled to every worker): plain frozen values, no vLLM types."""

from __future__ import annotations

from dataclasses import dataclass, field

from tspd_vllm.params import Rendezvous


@dataclass(frozen=True, slots=True)
class SendJob:
    """P: push a finished prefill's KV (``block_ids``: slot → vLLM block, the prompt's)."""

    rid: str
    rendezvous: Rendezvous
    block_ids: tuple[int, ...]
    prompt_len: int
    first_token: int


@dataclass(frozen=True, slots=True)
class RecvJob:
    """D: receive a prompt's KV into ``block_ids`` (slot → vLLM block); the first
    ``prefix_len`` tokens are D's own prefix-cache hit and are not sent."""

    rid: str
    rendezvous: Rendezvous
    block_ids: tuple[int, ...]
    prefix_len: int
    prompt_len: int


@dataclass(frozen=True, slots=True)
class EarlyRoom:
    """P, layerwise: register a request's room as vLLM first schedules it (before its
    prefill), so D can bootstrap it while the prefill runs."""

    rid: str
    rendezvous: Rendezvous


@dataclass(frozen=True, slots=True)
class ForwardRow:
    """P, layerwise: an early room's prompt tokens ``[start, end)`` this step's forward
    computes (``block_ids``: slot → vLLM block, at least up to ``end``); ``final``: the
    forward completes the prompt."""

    rid: str
    block_ids: tuple[int, ...]
    start: int
    end: int
    final: bool


@dataclass(frozen=True, slots=True)
class EndJob:
    """P, layerwise: an early room's request ended in vLLM without its prompt handed over.
    ``held``: vLLM finished it (aborted) and holds its blocks until the room's final event
    is reported; else vLLM preempted it (its blocks are gone already, nothing is reported)."""

    rid: str
    held: bool


@dataclass(frozen=True, slots=True)
class JobBatch:
    """One step's new jobs (P: ``room_aborts`` are rooms to fail, after the step's sends).

    Layerwise (P): ``early`` rooms to register, then ``ends`` to fail, then the sends (an
    early room's send hands over what its armed chunks did not carry), the room aborts, and
    ``rows``: the forward's rows of early rooms, armed if D bootstrapped them."""

    sends: tuple[SendJob, ...] = field(default=())
    recvs: tuple[RecvJob, ...] = field(default=())
    room_aborts: tuple[int, ...] = field(default=())
    early: tuple[EarlyRoom, ...] = field(default=())
    rows: tuple[ForwardRow, ...] = field(default=())
    ends: tuple[EndJob, ...] = field(default=())
