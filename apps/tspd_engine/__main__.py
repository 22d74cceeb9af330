"""Command line: ``python -m tspd_engine {generate,serve} [options]`` (run from apps/ or with
apps/ on PYTHONPATH).

``generate`` runs prompts through a replica and prints the completions; ``serve`` runs the
node HTTP endpoint (see :mod:`tspd_engine.server`) until interrupted. Both start TP ranks as
processes (``--tp``) and stop them cleanly on exit.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from tqdm import tqdm

from tspd_engine.config import EngineConfig, ModelConfig
from tspd_engine.errors import EngineError
from tspd_engine.frames import SamplingParams
from tspd_engine.launch import EngineHandle, launch
from tspd_engine.tokenizer import ByteTokenizer


def _engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--checkpoint", type=Path, help="Llama safetensors directory (default: seeded)")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the random weights")
    g.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel ranks (processes)")
    g.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    g.add_argument("--num-pages", type=int, default=d.num_pages, help="KV pages per rank")
    g.add_argument("--max-running", type=int, default=d.max_running, help="requests at once")
    g.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens)
    g.add_argument("--no-device-feed", action="store_true", help="synchronous decode loop")
    g.add_argument("--no-prefix-cache", action="store_true")
    g.add_argument("--page-layout", choices=["hnd", "nhd"], default=d.page_layout)
    g.add_argument("--device", default=d.device, help="cpu or cuda[:N]")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    g.add_argument("--threads", type=int, default=d.threads, help="torch threads per rank")


def _config(opts: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(dtype=opts.dtype), checkpoint=opts.checkpoint, seed=opts.seed,
        tp=opts.tp, page_size=opts.page_size, num_pages=opts.num_pages,
        max_running=opts.max_running, max_prefill_tokens=opts.max_prefill_tokens,
        prefix_cache=not opts.no_prefix_cache, device_feed=not opts.no_device_feed,
        page_layout=opts.page_layout, device=opts.device, threads=opts.threads,
    )  # fmt: skip


def _generate(handle: EngineHandle, opts: argparse.Namespace) -> None:
    tok = ByteTokenizer()
    params = SamplingParams(max_tokens=opts.max_tokens, ignore_eos=opts.ignore_eos)
    started = time.perf_counter()
    streams = [handle.client.submit(tok.encode(p), params) for p in opts.prompt]
    with tqdm(total=len(streams) * opts.max_tokens, unit="tok", disable=opts.quiet) as bar:
        for stream in streams:
            while stream.final is None:
                bar.update(len(stream.next_output().tokens))
    elapsed = time.perf_counter() - started
    generated = 0
    for prompt, stream in zip(opts.prompt, streams, strict=True):
        out = stream.result()
        generated += len(out.tokens)
        text = tok.decode([t for t in out.tokens if t < tok.vocab_size])
        print(f"{prompt!r} -> {text!r} [{out.finish.name.lower()}, {len(out.tokens)} tokens]")
    print(f"{generated} tokens in {elapsed:.2f} s ({generated / elapsed:.1f} tok/s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tspd_engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts and print the results")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    srv = sub.add_parser("serve", help="serve the node HTTP endpoint")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8100)
    for p in (gen, srv):
        _engine_args(p)
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = _config(opts)
        with launch(cfg) as handle:
            if opts.command == "generate":
                _generate(handle, opts)
            else:
                from tspd_engine.server import serve_http

                print(f"serving on http://{opts.host}:{opts.port} (tp={cfg.tp})", flush=True)
                serve_http(handle.client, ByteTokenizer(), opts.host, opts.port)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
