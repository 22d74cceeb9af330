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
class JobBatch:
    """One step's new jobs (P: ``room_aborts`` are rooms to fail, after the step's sends)."""

    sends: tuple[SendJob, ...] = field(default=())
    recvs: tuple[RecvJob, ...] = field(default=())
    room_aborts: tuple[int, ...] = field(default=())
