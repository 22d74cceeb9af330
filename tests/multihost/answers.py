"""What the multi-host tests compare against: a colocated engine's answers, and the router's
answers asked from the router's host."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import openai

from tspd_engine.config import EngineConfig
from tspd_engine.frames import SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_serving.openai.text import Detokenizer
from tspd_serving.tokenizer import ByteTokenizer

from .conftest import Cluster

TOK = ByteTokenizer()
MODEL = "tspd-tiny"


def colocated_texts(prompts: Sequence[str], max_tokens: int) -> list[str]:
    """What a colocated TP-1 engine answers (the nodes run the same seeded model)."""
    engine = Engine(EngineConfig(num_pages=4096, max_running=64, tp=1))
    try:
        outs = engine.generate([TOK.encode(p) for p in prompts], SamplingParams(max_tokens))
    finally:
        engine.close()
    texts = []
    for out in outs:
        d = Detokenizer()
        texts.append(d.feed(out.tokens) + d.flush())
    return texts


async def _complete_all(url: str, prompts: Sequence[str], max_tokens: int) -> list[str]:
    # Closed on this loop: a client left to GC closes on a dead loop, and asyncio logs that
    # error in whichever test runs then.
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0,
                                  timeout=120) as client:  # fmt: skip
        calls = [client.completions.create(model=MODEL, prompt=p, max_tokens=max_tokens)
                 for p in prompts]  # fmt: skip
        return [a.choices[0].text for a in await asyncio.gather(*calls)]


def complete_all(c: Cluster, prompts: Sequence[str], max_tokens: int) -> list[str]:
    """The router's answers to ``prompts``, asked from the router's host."""
    return c.net.call("r", lambda: asyncio.run(_complete_all(c.url("r"), prompts, max_tokens)))
