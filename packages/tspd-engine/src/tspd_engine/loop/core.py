"""The engine core of one rank: requests in, scheduler rounds, tokens out.

Every rank of a replica holds an identical core and feeds it the identical stream of intake
events (rank 0 broadcasts them), so every rank's scheduler admits, allocates and frees the
same pages in the same order. One :meth:`EngineCore.step` is one scheduler round::

    hooks.on_round (PD poll) → admit (FCFS, prefix cache) → [drain feed → prefill chunks]
      → decode round (sync, or fed: launch N+1 then commit N) → stop rules → outputs

Requests finish on EOS / stop ids / max_tokens / context limit; finishing releases every page,
including pages reserved for fed steps that were launched past the stop (their outputs are
dropped). Under page pressure the newest decoding request is preempted and recomputed later.

Threading: the rank's engine thread only.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np

from tspd_core import trace
from tspd_core.ids import RequestId
from tspd_core.sched import (
    BlockPool,
    PageArray,
    PoolExhausted,
    PrefixKvStore,
    RequestScheduler,
    page_keys,
)
from tspd_core.sched.request import RequestState
from tspd_engine.config import EngineConfig
from tspd_engine.frames import FinishReason, Output, RequestMode, Submit
from tspd_engine.loop.decoders import Committed, Decoder, FedDecoder, SyncDecoder
from tspd_engine.loop.digest import state_digest
from tspd_engine.loop.hooks import PdHooks
from tspd_engine.loop.limits import RequestLimits
from tspd_engine.loop.prefill import PrefillRound
from tspd_engine.loop.rows import RowViews
from tspd_engine.loop.runner import ModelRunner
from tspd_engine.loop.sequence import Sequence
from tspd_engine.model.build import build_model
from tspd_engine.model.config import ModelConfig
from tspd_engine.model.kv_arena import KvArena
from tspd_engine.model.tp import TpGroup

log = logging.getLogger(__name__)
#: States in which an aborted request's pages may be held for a transfer (no step in flight).
_HOLDABLE = (RequestState.AWAITING_KV, RequestState.PREFILL)


class EngineCore:
    """One rank's scheduler loop over its model shard and arena (see module docstring)."""

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, runner: ModelRunner) -> None:
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.runner = runner
        self.sched = runner.scheduler
        self.arena = runner.arena
        self.limit = cfg.max_model_len or model_cfg.max_position_embeddings
        self.eos = model_cfg.eos_token_id
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # admitted, in admission order
        rows = RowViews(self.sched, self.running, self.eos, self.limit)
        feed = cfg.device_feed and runner.supports_device_token_feed()
        self.decoder: Decoder = (
            FedDecoder(self.sched, runner, rows.masks, rows.more_wanted, rows.live_rows)
            if feed
            else SyncDecoder(self.sched, runner, rows.masks)
        )
        self.held: dict[str, Sequence] = {}  # PD prefill-only: done, pages held until release
        self._dirty: dict[str, Sequence] = {}
        self.hooks: list[PdHooks] = []
        self.limits = RequestLimits(model_cfg.vocab_size, self.limit, cfg.page_size, cfg.num_pages)
        self.prefill = PrefillRound(self.sched, runner, self.hooks, self.eos)
        self.initial_free_pages = self.sched.free_count()
        self.preemptions = 0  # requests recomputed after a page shortage (a metric)
        self.discarded_steps = 0  # fed steps launched past a stop, dropped at commit

    @classmethod
    def build(cls, cfg: EngineConfig, tp: TpGroup) -> EngineCore:
        """Model shard, arena, scheduler and runner for this rank of ``cfg``'s replica."""
        model, model_cfg = build_model(cfg, tp)
        arena = KvArena.build(model_cfg, cfg, tp.rank)
        pool = BlockPool(cfg.num_pages)
        store = PrefixKvStore(pool) if cfg.prefix_cache else None
        limit = cfg.max_model_len or model_cfg.max_position_embeddings
        logical = -(-limit // cfg.page_size)
        sched = RequestScheduler(
            cfg.max_running, logical, page_size=cfg.page_size, pool=pool, prefixes=store
        )
        return cls(cfg, model_cfg, ModelRunner(model, arena, sched, cfg.max_running))

    # -- intake (identical on every rank) -------------------------------------------------

    def submit(self, req: Submit) -> list[Output]:
        """Queue a request (``req.mode`` says GENERATE, or a PD half); a refused one comes
        back at once as an ERROR output. A PD prefill (``req.pd`` set) stays blocked in the
        queue until its hook calls :meth:`unblock` (its room is Bootstrapped) if the hook
        holds prefills (``PdHooks.holds_prefill``), else it is admitted as any request.

        Nothing a request holds may stop the loop: an unexpected exception while taking it
        fails that request alone (an ERROR output; whatever a hook began for it is aborted).
        Every rank takes the same request the same way, so all reach the same verdict. A PD
        prefill refused here has its room failed (:meth:`abort_room`), so a D that
        pre-allocated it hears now rather than at P's bootstrap timeout."""
        known = self._known(req.rid)
        try:
            outputs = self._submit(req)
        except Exception as exc:
            log.exception("request %s failed on submit; failing it alone", req.rid)
            if not known:
                self._forget_broken(req.rid)
            why = f"the engine could not take this request: {type(exc).__name__}: {exc}"
            outputs = [Output(req.rid, (), FinishReason.ERROR, why[:500], len(req.prompt))]
        if outputs and req.pd is not None and req.mode == RequestMode.PREFILL_ONLY:
            # Refused: its room will never be served here, and D may have pre-allocated it.
            self.abort_room(req.pd.room, "the prefill engine refused the request")
        return outputs

    def _submit(self, req: Submit) -> list[Output]:
        # Wide enough for any id a frame carries; the vocabulary check comes before int32.
        wide = np.asarray(req.prompt, dtype=np.int64)
        problem = self.limits.id_refusal(wide)
        prompt = wide.astype(np.int32) if not problem else np.zeros(len(wide), np.int32)
        seq = Sequence(req.rid, prompt, req.params, req.mode, pd=req.pd)
        problem = problem or self._refusal(seq)
        if problem:
            seq.finish, seq.error = FinishReason.ERROR, problem
            out = seq.take_output()
            return [out] if out else []
        pd_prefill = req.pd is not None and req.mode == RequestMode.PREFILL_ONLY
        seq.blocked = pd_prefill and any(hooks.holds_prefill() for hooks in self.hooks)
        self.waiting.append(seq)
        return []

    def _forget_broken(self, rid: str) -> None:
        """Undo what a failed submit may have begun for ``rid`` (queue entry, hooks' rooms)."""
        self.waiting = deque(s for s in self.waiting if s.rid != rid)
        for hooks in self.hooks:
            try:
                if hooks.on_abort(rid) and rid in self.held:
                    self.release_held(rid)
            except Exception:
                log.exception("hook %s could not abort %s", type(hooks).__name__, rid)

    def _refusal(self, seq: Sequence) -> str:
        # The hooks have the last word: a PD link registers the request's room when it accepts.
        if self._known(seq.rid):
            return f"request id {seq.rid!r} is already in use"
        problem = self.limits.refusal(seq)
        if problem:
            return problem
        if seq.pd is not None and not self.hooks:
            return "this engine has no PD peer: it cannot serve a request with a room"
        return next((p for hooks in self.hooks if (p := hooks.on_submit(seq))), "")

    def _known(self, rid: str) -> bool:
        return rid in self.running or rid in self.held or any(s.rid == rid for s in self.waiting)

    def abort(self, rid: str) -> list[Output]:
        """Stop a request wherever it is (a client's abort). Its pages are released at once,
        unless a hook says a transfer may still touch them (``PdHooks.on_abort``): then the
        client is answered now and the pages wait for ``release_held``. Unknown ids (e.g.
        already finished) are ignored."""
        keep = [hooks.on_abort(rid) for hooks in self.hooks]
        self._abort(rid, FinishReason.ABORT, "", keep=any(keep))
        return self._outputs()

    def abort_room(self, room: int, reason: str) -> None:
        """Fail a PD room no request here will serve (a refused request's, or one a client
        gave up before it arrived): the hooks fail it towards the other half
        (``PdHooks.on_abort_room``; a room a tracked request holds is left to that request).
        Never raises: a hook's error is logged, and the round goes on."""
        for hooks in self.hooks:
            try:
                hooks.on_abort_room(room, reason)
            except Exception:  # the same on every rank: each logs it and goes on
                log.exception("hook %s could not abort room %d", type(hooks).__name__, room)

    def fail(self, rid: str, error: str, reason: FinishReason = FinishReason.ERROR) -> None:
        """End a request with ``error`` (a hook's verdict, e.g. TRANSFER when its KV transfer
        failed); its pages are released at once. Unknown ids are ignored."""
        self._abort(rid, reason, error)

    def unblock(self, rid: str) -> None:
        """Let a blocked PD prefill be admitted (its room is Bootstrapped)."""
        for seq in self.waiting:
            if seq.rid == rid:
                seq.blocked = False
                return
        raise ValueError(f"request {rid!r} is not waiting")

    def abort_all(self, error: str) -> list[Output]:
        """Fail every tracked request (shutdown); the pool returns to its initial state."""
        self._apply(self.decoder.drain())
        for rid in [*(s.rid for s in self.waiting), *self.running, *self.held]:
            self._abort(rid, FinishReason.ERROR, error)
        return self._outputs()

    def _abort(self, rid: str, reason: FinishReason, error: str, keep: bool = False) -> None:
        if rid in self.held:
            if not keep:
                self.release_held(rid)  # already answered: only its pages remain
            return
        if rid in self.running:
            seq = self.running[rid]
            # Only requests with no decode step in flight can be held: D awaiting its KV, or
            # P between the chunks of a prefill whose earlier chunks stream layerwise.
            if keep and self.sched.state(RequestId(rid)) in _HOLDABLE:
                self._hold(seq, reason)
            else:
                self._finish(seq, reason)
        else:
            found = [s for s in self.waiting if s.rid == rid]
            if not found:
                return
            seq = found[0]
            self.waiting.remove(seq)
            seq.finish = reason
            self._dirty[rid] = seq
        seq.error = error

    def fork(self, parent: str, child: str) -> None:
        """Start ``child`` as a copy of the decoding request ``parent`` that shares all of its
        pages (parallel sampling); the first write of either into the shared last page is
        copied on write. Steps in flight are committed first. On a TP replica call it from a
        round hook so every rank forks in the same round."""
        seq = self.running[parent]
        if self._known(child):
            raise ValueError(f"request id {child!r} is already in use")
        self._apply(self.decoder.drain())
        if parent not in self.running:
            raise ValueError(f"request {parent!r} finished before it could be forked")
        adm = self.sched.fork(RequestId(parent), RequestId(child))
        twin = Sequence(child, seq.prompt, seq.params, seq.mode, list(seq.output))
        twin.cached, twin.preemptions, twin.serial = seq.cached, seq.preemptions, adm.serial
        self.running[child] = twin

    # -- PD hooks (see docs/engine.md) ------------------------------------------------------

    def add_hooks(self, hooks: PdHooks) -> None:
        """Register callbacks; ``on_round`` runs at the start of every round on every rank,
        in registration order (where a PD peer's ``poll`` runs)."""
        self.hooks.append(hooks)

    def start_remote_decode(self, rid: str, first_token: int) -> None:
        """A REMOTE_DECODE request's prompt KV has arrived with ``first_token``: decode."""
        seq = self.running[rid]
        if self.sched.state(RequestId(rid)) != RequestState.AWAITING_KV:
            raise ValueError(f"request {rid!r} is not waiting for remote KV")
        self._accept(seq, first_token)

    def release_held(self, rid: str) -> None:
        """Release the pages of a held request: a PREFILL_ONLY request whose KV has been sent,
        or an aborted one a transfer could still write into (see :meth:`abort`)."""
        seq = self.held.pop(rid)
        self.sched.finish(RequestId(rid))
        self._dirty[rid] = seq

    release_prefill = release_held

    def is_held(self, rid: str) -> bool:
        """Whether ``rid`` was answered but its pages are held (see :meth:`abort`)."""
        return rid in self.held

    def cached_tokens(self, rid: str) -> int:
        """Prompt tokens of a tracked request served by the prefix cache at its admission."""
        return self._admitted(rid).cached

    def prompt_len(self, rid: str) -> int:
        """The prompt length of a tracked request (its prefill's last token + 1)."""
        return len(self._admitted(rid).prompt)

    def _admitted(self, rid: str) -> Sequence:
        seq = self.held.get(rid) or self.running.get(rid)
        if seq is None:
            raise ValueError(f"request {rid!r} is not admitted")
        return seq

    def _hold(self, seq: Sequence, reason: FinishReason) -> None:
        """Answer the client now but keep the pages (a transfer may still read or write
        them); only for a request with no decode step in flight (see ``_HOLDABLE``)."""
        del self.running[seq.rid]
        seq.finish = reason
        self.held[seq.rid] = seq
        self._dirty[seq.rid] = seq

    @property
    def tp(self) -> TpGroup:
        """This rank's TP group (the replica a PD peer's agreement reduces over)."""
        return self.runner.model.tp

    def page_table(self, rid: str) -> PageArray:
        return self.sched.page_table(RequestId(rid))

    def zero_pages(self, pages: PageArray) -> None:
        """Zero pages that will receive remote KV (a D node does so before its manifest)."""
        self.arena.zero_pages(pages)

    # -- the round -------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        """Anything tracked: a round must run (PD hooks poll even for held requests)."""
        tracked = self.waiting or self.running or self.held or self.decoder.in_flight
        return bool(tracked) or any(hooks.has_pending() for hooks in self.hooks)

    def after_round(self) -> None:
        """The round's outputs went out: let the hooks do what they deferred (see
        ``PdHooks.after_round``). Whoever runs rounds calls it after each :meth:`step`."""
        for hooks in self.hooks:
            hooks.after_round()

    def on_idle(self) -> None:
        """The loop is about to wait with nothing tracked: let the hooks hand over what they
        deferred (see ``PdHooks.on_idle``)."""
        for hooks in self.hooks:
            hooks.on_idle()

    def wake_fds(self) -> list[int]:
        """Descriptors that should end the loop's wait for intake: the hooks' (a PD peer's
        worker notes) while a request is tracked. Idle, none: a late note for a forgotten
        room stays unread until the next round, instead of ending every wait."""
        if not self.has_work:
            return []
        return [fd for hooks in self.hooks for fd in hooks.wake_fds()]

    @property
    def busy(self) -> bool:
        """Something can compute now (the loop should not wait for intake)."""
        if self.decoder.in_flight or any(not s.blocked for s in self.waiting):
            return True
        if self.has_work and any(hooks.has_news() for hooks in self.hooks):
            # The next round may carry a follow-up event (one per round). Only while work is
            # tracked: idle, no round runs to clear the flag, and the loop would spin.
            return True
        return any(
            self.sched.state(RequestId(r)) in (RequestState.PREFILL, RequestState.DECODE)
            for r in self.running
        )

    def step(self) -> list[Output]:
        """One scheduler round; returns the outputs it produced (new tokens, finishes)."""
        for hooks in self.hooks:
            hooks.on_round(self)
        self._admit()
        if any(self.sched.state(RequestId(r)) == RequestState.PREFILL for r in self.running):
            self._apply(self.decoder.drain())
            if trace.enabled():
                for rid in self.running:
                    if self.sched.state(RequestId(rid)) == RequestState.PREFILL:
                        trace.mark(rid, "engine.prefill")
            for seq, token in self.prefill.run(self.running.values(), self.cfg.max_prefill_tokens):
                self._prefill_done(seq, token)
        self._apply(self._decode())
        return self._outputs()

    def _admit(self) -> None:
        # FCFS over the admissible requests; blocked PD prefills keep their place in line.
        for seq in [s for s in self.waiting if not s.blocked]:
            tokens = seq.tokens()
            keys = page_keys(tokens, self.cfg.page_size) if self.cfg.prefix_cache else None
            # A preempted PD decode recomputes its prompt here: no second transfer.
            remote = seq.mode == RequestMode.REMOTE_DECODE and seq.preemptions == 0
            if not self._room_for(len(tokens)):
                return
            adm = self.sched.try_admit(RequestId(seq.rid), len(tokens), keys, remote_kv=remote)
            if adm is None:
                return
            self.waiting.remove(seq)
            if seq.preemptions == 0:  # the first admission: its hit is what the client sees
                seq.cached = adm.prefix_tokens
            seq.serial = adm.serial
            self.running[seq.rid] = seq
            trace.mark(seq.rid, "engine.admitted")
            if remote:
                for hooks in self.hooks:
                    hooks.on_remote_admitted(seq.rid, adm)

    def _room_for(self, prompt_len: int) -> bool:
        # Keep one page per running request in reserve (its next decode page), so that a new
        # admission does not force a preemption in the very next round. An idle engine
        # admits anything that fits.
        if not self.running:
            return True
        need = -(-prompt_len // self.cfg.page_size)
        return self.sched.reclaimable_count() - need >= len(self.running)

    def _prefill_done(self, seq: Sequence, token: int) -> None:
        trace.mark(seq.rid, "engine.prefilled")
        rid = RequestId(seq.rid)
        self.sched.mark_prefill_complete(rid)
        if seq.mode == RequestMode.PREFILL_ONLY:
            seq.output.append(token)
            seq.finish = FinishReason.LENGTH
            self._dirty[seq.rid] = seq
            self.held[seq.rid] = self.running.pop(seq.rid)
            for hooks in self.hooks:
                hooks.on_prefill_done(seq.rid, token, self.page_table(seq.rid))
            return
        self._accept(seq, token)

    def _accept(self, seq: Sequence, token: int) -> None:
        """Append a host-known token (after prefill or a remote seed) and decode on."""
        seq.output.append(token)
        self._dirty[seq.rid] = seq
        reason = seq.stop_reason(token, self.eos, self.limit)
        if reason:
            self._finish(seq, reason)
        else:
            self.sched.seed_decode_token(RequestId(seq.rid), token)

    def _decode(self) -> Committed:
        while True:
            try:
                return self.decoder.step()
            except PoolExhausted:
                # Nothing changed in the scheduler; settle what is in flight, then make room.
                self._apply(self.decoder.drain())
                if not self._preempt_newest():
                    self._fail_alone()

    def _preempt_newest(self) -> bool:
        decoding = [s for s in self.running.values() if self._decoding(s.rid)]
        if len(decoding) <= 1:
            return False  # one request alone outgrew the pool: nothing to make room with
        victim = decoding[-1]
        log.info("preempting %s (KV pages exhausted); it will be recomputed", victim.rid)
        self.sched.finish(RequestId(victim.rid))
        del self.running[victim.rid]
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)
        return True

    def _decoding(self, rid: str) -> bool:
        return self.sched.state(RequestId(rid)) == RequestState.DECODE

    def _fail_alone(self) -> None:
        # One request outgrew the whole pool: fail it rather than the replica.
        for seq in reversed(self.running.values()):
            if self._decoding(seq.rid):
                self._finish(seq, FinishReason.ERROR)
                seq.error = f"KV cache full: {self.cfg.num_pages} pages cannot hold this request"
                return

    def _apply(self, committed: Committed) -> None:
        for rid, token in committed:
            seq = self.running[rid]
            seq.output.append(token)
            self._dirty[rid] = seq
            reason = seq.stop_reason(token, self.eos, self.limit)
            if reason:
                self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        rid = RequestId(seq.rid)
        pending = self.sched.view(rid).pending
        if pending:
            # Fed steps launched past the stop: give back the pages only they reserved.
            self.runner.release_decode_blocks(rid, self.runner.reserve_decode_block(rid))
            self.discarded_steps += pending
        self.sched.finish(rid)
        del self.running[seq.rid]
        seq.finish = reason
        self._dirty[seq.rid] = seq

    def _outputs(self) -> list[Output]:
        outs = [o for s in self._dirty.values() if (o := s.take_output()) is not None]
        self._dirty.clear()
        return outs

    def stats(self) -> dict[str, float]:
        """This rank's counters (identical on every rank of the replica, except what hooks
        add from their transfer workers): the KV pool, queue lengths, loop metrics."""
        values: dict[str, float] = {
            "total_pages": self.cfg.num_pages,
            "initial_free_pages": self.initial_free_pages,
            "free_pages": self.sched.free_count(),
            "reclaimable_pages": self.sched.reclaimable_count(),
            "waiting": len(self.waiting),
            "blocked": sum(s.blocked for s in self.waiting),
            "running": len(self.running),
            "held": len(self.held),
            "preemptions": self.preemptions,
            "discarded_steps": self.discarded_steps,
            "forward_tokens": self.runner.forward_tokens,
        }
        for hooks in self.hooks:
            values |= hooks.stats()
        return values

    def state_digest(self) -> int:
        """A 63-bit digest of the scheduler state every rank must share (requests, their page
        tables and lengths, free pages): equal digests mean equal block ids on every rank."""
        return state_digest(self.sched, len(self.waiting), [*self.running, *self.held])

    def close(self) -> None:
        """Stop the decoder, then every hook (PD peers stop their transfer workers)."""
        self.decoder.close()
        for hooks in self.hooks:
            hooks.close()
