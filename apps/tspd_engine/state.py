"""What the core says about itself: request refusals, counters and the cross-rank digest.

Pure reads of an :class:`~tspd_engine.core.EngineCore` (plus the hooks' ``on_submit``
verdicts), kept out of the loop's module so the loop reads top to bottom.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

from tspd_core.ids import RequestId

if TYPE_CHECKING:
    from tspd_engine.core import EngineCore
    from tspd_engine.sequence import Sequence


def refusal(core: EngineCore, seq: Sequence) -> str:
    """Why ``seq`` cannot be queued, or ``""``; the hooks have the last word (a PD link
    registers the request's room when it accepts it)."""
    return _check(core, seq) or _check_hooks(core, seq)


def _check(core: EngineCore, seq: Sequence) -> str:
    if (
        seq.rid in core.running
        or seq.rid in core.held
        or any(s.rid == seq.rid for s in core.waiting)
    ):
        return f"request id {seq.rid!r} is already in use"
    n, vocab = len(seq.prompt), core.model_cfg.vocab_size
    if n == 0:
        return "prompt is empty"
    if int(seq.prompt.min()) < 0 or int(seq.prompt.max()) >= vocab:
        return f"prompt token ids must lie in 0..{vocab - 1}"
    if n >= core.limit:
        return f"prompt of {n} tokens leaves no room below the context limit {core.limit}"
    if -(-n // core.cfg.page_size) > core.cfg.num_pages:
        return f"prompt of {n} tokens needs more KV pages than the cache has"
    return ""


def _check_hooks(core: EngineCore, seq: Sequence) -> str:
    if seq.pd is not None and not core.hooks:
        return "this engine has no PD peer: it cannot serve a request with a room"
    for hooks in core.hooks:
        problem = hooks.on_submit(seq)
        if problem:
            return problem
    return ""


def core_stats(core: EngineCore) -> dict[str, float]:
    """Counters of one rank (identical on every rank of the replica, except what hooks add
    from their transfer workers): the KV pool, queue lengths, loop metrics."""
    values: dict[str, float] = {
        "total_pages": core.cfg.num_pages,
        "initial_free_pages": core.initial_free_pages,
        "free_pages": core.sched.free_count(),
        "reclaimable_pages": core.sched.reclaimable_count(),
        "waiting": len(core.waiting),
        "blocked": sum(s.blocked for s in core.waiting),
        "running": len(core.running),
        "held": len(core.held),
        "preemptions": core.preemptions,
        "discarded_steps": core.discarded_steps,
        "forward_tokens": core.runner.forward_tokens,
    }
    for hooks in core.hooks:
        values |= hooks.stats()
    return values


def state_digest(core: EngineCore) -> int:
    """A 63-bit digest of the scheduler state every rank must share (requests, their page
    tables and lengths, free pages): equal digests mean equal block ids on every rank."""
    sched = core.sched
    h = hashlib.blake2b(digest_size=8)
    h.update(np.array([sched.free_count(), len(core.waiting)], np.int64).tobytes())
    for rid in [*core.running, *core.held]:
        view = sched.view(RequestId(rid))
        h.update(rid.encode() + b"\0")
        h.update(np.array([view.num_tokens, view.pending], np.int64).tobytes())
        h.update(sched.page_table(RequestId(rid)).tobytes())
    return int.from_bytes(h.digest(), "little") >> 1
