"""Benchmark runner: `python benchmarks/run.py [name ...] [--quick] [bench options]`.

Options the runner does not know go to the one benchmark named (e.g. `run.py e2e --only pd`;
`run.py e2e --help-bench` shows that benchmark's own options).

Each `benchmarks/bench_<name>.py` defines `run(args: list[str]) -> dict[str, object]`, prints
its own table (ratios against a baseline measured in the same process) and returns the
machine-readable results, which land in `bench-results/<name>.json`. Benchmarks never assert
absolute times; they report.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE.parent / "bench-results"


def available() -> list[str]:
    return sorted(p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))


def load(name: str) -> object:
    path = HERE / f"bench_{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    names = available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {names})")
    parser.add_argument("--quick", action="store_true", help="smaller inputs, for a smoke run")
    parser.add_argument(
        "--help-bench", action="store_true", help="show the named benchmark's own options"
    )
    opts, extra = parser.parse_known_args()
    unknown = sorted(set(opts.names) - set(names))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; available: {names}")
    if (extra or opts.help_bench) and len(opts.names) != 1:
        parser.error(f"benchmark options {extra} need exactly one benchmark named")
    if opts.help_bench:
        extra = ["--help"]
    RESULTS.mkdir(exist_ok=True)
    for name in opts.names or names:
        print(f"\n=== bench: {name} ===", flush=True)
        module = load(name)
        started = time.time()
        args = (["--quick"] if opts.quick else []) + extra
        result = module.run(args)  # type: ignore[attr-defined]
        payload = {
            "benchmark": name,
            "started_unix": started,
            "wall_s": round(time.time() - started, 3),
            "machine": {"python": platform.python_version(), "cpu_count": _cpus()},
            "results": result,
        }
        out = RESULTS / f"{name}.json"
        out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        print(f"-> {out.relative_to(HERE.parent)}")
    return 0


def _cpus() -> int:
    import os

    return os.cpu_count() or 1


if __name__ == "__main__":
    raise SystemExit(main())
