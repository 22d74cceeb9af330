"""Command line: ``tspd-engine {generate,serve} [options]`` (``python -m tspd_engine``).

``generate`` runs prompts through a replica and prints the completions; ``serve`` runs the
node HTTP endpoint (see :mod:`tspd_engine.node.endpoint`) until interrupted. Both start TP ranks as
processes (``--tp``) and stop them cleanly on exit.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from tqdm import tqdm

from tspd_engine.frames import SamplingParams
from tspd_engine.node.cliargs import add_engine_args, add_step_log_arg, engine_config
from tspd_engine.node.endpoint import serve_http
from tspd_engine.rank.launch import EngineHandle, launch
from tspd_serving.cliargs import count, port
from tspd_serving.errors import ServingError
from tspd_serving.hf_tokenizer import load_tokenizer
from tspd_serving.http import bind_socket


def _generate(handle: EngineHandle, opts: argparse.Namespace) -> None:
    tok = load_tokenizer(opts.checkpoint)
    extra = () if opts.ignore_eos else tok.eos_token_ids[1:]  # a model's other EOS ids
    params = SamplingParams(
        max_tokens=opts.max_tokens, stop_token_ids=extra, ignore_eos=opts.ignore_eos
    )
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
        text = tok.decode(out.tokens)
        print(f"{prompt!r} -> {text!r} [{out.finish.name.lower()}, {len(out.tokens)} tokens]")
    print(f"{generated} tokens in {elapsed:.2f} s ({generated / elapsed:.1f} tok/s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tspd-engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts and print the results")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=count, default=32, help="(default: %(default)s)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    srv = sub.add_parser("serve", help="serve the node HTTP endpoint")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    srv.add_argument("--port", type=port, default=8100, help="0 = any free port (default: 8100)")
    for p in (gen, srv):
        add_engine_args(p)
    add_step_log_arg(srv)
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = engine_config(opts)
        sock = None
        if opts.command == "serve":  # bound before the ranks start: a taken port fails fast
            sock = bind_socket(opts.host, opts.port, "choose another --port")
        with launch(cfg) as handle:
            if sock is None:
                _generate(handle, opts)
            else:
                url = f"http://{opts.host}:{sock.getsockname()[1]}"
                print(f"serving on {url} (tp={cfg.tp})", flush=True)
                serve_http(handle.client, load_tokenizer(opts.checkpoint), sock)
    except ServingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
