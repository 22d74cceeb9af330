"""In-process engine: one TP-1 rank driven from the caller's thread (tests, notebooks, bench).

For TP > 1, or to serve other processes, use :func:`tspd_engine.rank.launch.launch`, which runs the
same :class:`~tspd_engine.loop.core.EngineCore` in rank processes behind an ``EngineClient``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch

from tspd_engine.config import EngineConfig
from tspd_engine.frames import Output, RequestMode, SamplingParams, Submit
from tspd_engine.loop.core import EngineCore
from tspd_engine.model.tp import TpGroup
from tspd_serving.errors import RequestError


class Engine:
    """A single-rank engine; not thread-safe (one caller drives it)."""

    def __init__(self, cfg: EngineConfig) -> None:
        if cfg.tp != 1:
            raise RequestError(f"Engine runs one rank in-process; tp={cfg.tp} needs launch()")
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)  # process-wide: this engine runs in-process
        self.core = EngineCore.build(cfg, TpGroup())
        self._ids = itertools.count()
        self._results: dict[str, Output] = {}

    def add(
        self,
        prompt: Sequence[int],
        params: SamplingParams | None = None,
        rid: str | None = None,
        mode: RequestMode = RequestMode.GENERATE,
    ) -> str:
        """Queue one request; returns its id. Refusals surface in the results as ERROR."""
        rid = rid or f"req-{next(self._ids)}"
        ids = tuple(int(t) for t in prompt)
        self._collect(self.core.submit(Submit(rid, ids, params or SamplingParams(), mode=mode)))
        return rid

    def step(self) -> list[Output]:
        """One scheduler round (runs only when there is work)."""
        outs = self.core.step() if self.core.has_work else []
        self._collect(outs)
        self.core.after_round()
        return outs

    def abort(self, rid: str) -> list[Output]:
        """Stop a request now (its pages are released); returns the final output."""
        outs = self.core.abort(rid)
        self._collect(outs)
        return outs

    def run(self, max_rounds: int | None = None) -> dict[str, Output]:
        """Step until every request finished (or ``max_rounds``); the merged outputs by id."""
        for _ in range(max_rounds) if max_rounds is not None else itertools.count():
            if not self.core.has_work:
                break
            self.step()
        return dict(self._results)

    def generate(
        self, prompts: Iterable[Sequence[int]], params: SamplingParams | None = None
    ) -> list[Output]:
        """Greedy continuations of ``prompts`` (batched); outputs in prompt order."""
        rids = [self.add(p, params) for p in prompts]
        results = self.run()
        return [results[r] for r in rids]

    def _collect(self, outs: list[Output]) -> None:
        for out in outs:
            prev = self._results.get(out.rid)
            tokens = (prev.tokens if prev else ()) + out.tokens
            self._results[out.rid] = Output(
                out.rid, tokens, out.finish, out.error, out.prompt_tokens, out.cached_tokens
            )

    def close(self) -> None:
        self.core.close()
