"""The engine's command-line flags, shared by ``python -m tspd_engine`` and the launcher."""

from __future__ import annotations

import argparse
from pathlib import Path

from tspd_engine.config import EngineConfig, ModelConfig


def add_engine_args(parser: argparse.ArgumentParser, tp: bool = True) -> None:
    """Model and engine flags (``tp=False`` leaves ``--tp`` to the caller)."""
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        "--checkpoint",
        dest="checkpoint",
        type=Path,
        metavar="DIR",
        help="Llama safetensors directory (default: the tiny seeded model)",
    )
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the random weights")
    if tp:
        g.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel ranks (processes)")
    g.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    g.add_argument("--num-pages", type=int, default=d.num_pages, help="KV pages per rank")
    g.add_argument("--max-running", type=int, default=d.max_running, help="requests at once")
    g.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=d.max_prefill_tokens,
        help="prompt tokens one round may prefill (longer prompts are chunked)",
    )
    g.add_argument("--max-model-len", type=int, help="longest prompt + output, in tokens")
    g.add_argument("--no-device-feed", action="store_true", help="synchronous decode loop")
    g.add_argument("--no-prefix-cache", action="store_true")
    g.add_argument("--page-layout", choices=["hnd", "nhd"], default=d.page_layout)
    g.add_argument("--device", default=d.device, help="cpu or cuda[:N]")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    g.add_argument("--threads", type=int, default=d.threads, help="torch threads per rank")


def engine_config(opts: argparse.Namespace, tp: int | None = None) -> EngineConfig:
    """The config the flags describe (``tp`` overrides ``--tp``); ConfigError if invalid."""
    return EngineConfig(
        model=ModelConfig(dtype=opts.dtype), checkpoint=opts.checkpoint, seed=opts.seed,
        tp=tp if tp is not None else opts.tp, page_size=opts.page_size,
        num_pages=opts.num_pages, max_running=opts.max_running,
        max_prefill_tokens=opts.max_prefill_tokens, max_model_len=opts.max_model_len,
        prefix_cache=not opts.no_prefix_cache, device_feed=not opts.no_device_feed,
        page_layout=opts.page_layout, device=opts.device, threads=opts.threads,
    )  # fmt: skip
