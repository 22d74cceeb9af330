"""``tspd-vllm``: the PD front for vLLM nodes, and SmolLM2 as a Hugging Face folder.

    tspd-vllm export-model OUT [--model smollm2-135m]
    tspd-vllm front --prefill URL[@HOST:PORT] ... --decode URL ... [--flow sequential]
                    [--host 127.0.0.1] [--port 8000]

Exit status: 0 after SIGINT/SIGTERM, 1 when the front cannot bind or the export fails,
2 for bad arguments. The front prints one line once bound:
``tspd-vllm front: serving on http://HOST:PORT (FLOW)``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from tspd_vllm.errors import ModelExportError, SettingsError
from tspd_vllm.front import Flow, Front, Prefill, serve


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tspd-vllm", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export-model", help="write a GGUF model as a Hugging Face folder")
    exp.add_argument("out", type=Path)
    exp.add_argument("--model", default="smollm2-135m", help="a GGUF file or a packaged name")
    front = sub.add_parser("front", help="an OpenAI-compatible PD front for vLLM nodes")
    front.add_argument("--prefill", action="append", required=True, metavar="URL[@HOST:PORT]")
    front.add_argument("--decode", action="append", required=True, metavar="URL")
    front.add_argument("--flow", choices=[f.value for f in Flow], default=Flow.SEQUENTIAL.value)
    front.add_argument("--host", default="127.0.0.1")
    front.add_argument("--port", type=int, default=8000)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "export-model":
        try:
            print(export(args.out, args.model))
        except ModelExportError as exc:
            print(f"tspd-vllm: {exc}", file=sys.stderr)
            return 1
        return 0
    try:
        front = Front([Prefill.parse(p) for p in args.prefill], args.decode, Flow(args.flow))
    except SettingsError as exc:
        print(f"tspd-vllm: {exc}", file=sys.stderr)
        return 2
    return _run_front(front, args.host, args.port)


def export(out: Path, model: str) -> Path:
    from tspd_vllm.model import export_model

    return export_model(out, model)


def _run_front(front: Front, host: str, port: int) -> int:
    def ready(bound: int) -> None:
        print(f"tspd-vllm front: serving on http://{host}:{bound} ({front.flow})", flush=True)

    async def run() -> None:
        task = asyncio.ensure_future(serve(front, host, port, ready))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass

    try:
        asyncio.run(run())
    except OSError as exc:
        print(f"tspd-vllm: cannot serve on {host}:{port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
