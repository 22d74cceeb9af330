"""The workspace's wheels as a user installs them (``nox -s packaging``; needs the package index).

1. Every member's wheel is built (``pip wheel --no-deps``: the members' own build backends, in
   isolation, as a release would build them).
2. The router's set (tspd-serving, tspd-core, tspd-router) goes into a fresh virtual
   environment, with what those wheels declare and nothing else: ``import torch`` must fail
   there, ``tspd-router --help`` must run, and a router started from it must answer
   ``GET /health`` (503: its one node is unreachable) and ``GET /openapi.json``, then stop
   cleanly on SIGTERM.
3. Every wheel goes into another fresh environment, torch's CPU build first and pinned (as
   ``./nox`` installs it: no transitive range may then pull a multi-GB CUDA build): the
   console scripts ``tspd-launch``, ``tspd-engine``, ``tspd-router``, ``tspd-bootstrap`` and
   ``tspd-sim`` must be on its PATH and answer ``--help``.

The wheels are given to pip as files, never by name: a name on the public index (``tspd-core``
there is not ours) cannot stand in for a member. Prints what it checked; exits 1 on the first
failure. ``--keep DIR`` builds in DIR and leaves it (wheels and environments) for a look.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: torch as ./nox pins it (noxfile.TORCH, which ``nox -s packaging`` passes): the CPU build.
TORCH = "torch==2.13.0"
MEMBERS = sorted(p.parent for p in (ROOT / "packages").glob("*/pyproject.toml"))
ROUTER_SET = ("tspd_serving", "tspd_core", "tspd_router")
SCRIPTS = ("tspd-launch", "tspd-engine", "tspd-router", "tspd-bootstrap", "tspd-sim")
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


class CheckFailed(Exception):
    """One check of the installed wheels did not hold."""


def run(*argv: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``argv``, its output captured; CheckFailed (with the output's tail) if it fails."""
    shown = " ".join(str(a) for a in argv)
    print(f"$ {shown}", flush=True)
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise CheckFailed(f"{shown} exited with {done.returncode}:\n{tail}")
    return done


def build_wheels(out: Path) -> dict[str, Path]:
    """Each member's wheel, by its import name's spelling of the distribution."""
    for member in MEMBERS:
        run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, member)
    wheels = {w.name.split("-")[0]: w for w in out.glob("*.whl")}
    want = {m.name.replace("-", "_") for m in MEMBERS}
    if set(wheels) != want:
        raise CheckFailed(f"wheels built: {sorted(wheels)}, members: {sorted(want)}")
    return wheels


def venv(path: Path) -> Path:
    """A fresh virtual environment at ``path`` (pip upgraded); its bin directory."""
    run(sys.executable, "-m", "venv", path)
    run(path / "bin" / "python", "-m", "pip", "install", "-q", "--upgrade", "pip")
    return path / "bin"


def pip_install(bin_dir: Path, *args: str | Path) -> None:
    run(bin_dir / "python", "-m", "pip", "install", "-q", *args)


def check_router_set(wheels: dict[str, Path], where: Path) -> None:
    bin_dir = venv(where)
    pip_install(bin_dir, *(wheels[name] for name in ROUTER_SET))
    probe = subprocess.run([str(bin_dir / "python"), "-c", "import torch"],
                           capture_output=True, text=True)  # fmt: skip
    if probe.returncode == 0 or "No module named 'torch'" not in probe.stderr:
        raise CheckFailed(f"the router's environment imports torch: {probe.stderr[-500:]!r}")
    print("router set: import torch fails (ModuleNotFoundError)", flush=True)
    imported = run(bin_dir / "python", "-c", "import sys, tspd_router.cli, tspd_router.app; "
                   "print(sorted(m for m in ('tspd_engine', 'zmq', 'mooncake') "
                   "if m in sys.modules))")  # fmt: skip
    if imported.stdout.strip() != "[]":
        raise CheckFailed(f"the router imported {imported.stdout.strip()}")
    usage = run(bin_dir / "tspd-router", "--help").stdout
    if not usage.startswith("usage: tspd-router "):
        raise CheckFailed(f"tspd-router --help printed {usage[:200]!r}")
    print("router set: tspd-router --help", flush=True)
    serve_once(bin_dir / "tspd-router")


def serve_once(router: Path) -> None:
    """Start ``router`` on a free port in front of one unreachable node; check two doors."""
    argv = [str(router), "--port", "0", "--colocated", "http://127.0.0.1:9", "--log-level",
            "warning"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = _ready_url(proc)
        status, body = _get(f"{url}/health")
        want = {"status": "unavailable", "colocated": {"healthy": 0, "total": 1}}
        if (status, body) != (503, want):
            raise CheckFailed(f"GET /health: {status} {body}, want 503 {want}")
        status, doc = _get(f"{url}/openapi.json")
        paths = set(doc.get("paths", ()))
        if status != 200 or doc.get("openapi") != "3.0.3" or "/v1/chat/completions" not in paths:
            raise CheckFailed(f"GET /openapi.json: {status}, openapi {doc.get('openapi')!r}, "
                              f"paths {sorted(paths)}")  # fmt: skip
        print(f"router set: a router at {url} answers /health (503) and /openapi.json "
              f"({len(paths)} paths)", flush=True)  # fmt: skip
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=STOP_TIMEOUT_S)
        if code != 0:
            raise CheckFailed(f"the router exited with {code} on SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _ready_url(proc: subprocess.Popen[str]) -> str:
    """The URL of the router's ``router ready on URL`` line (read on a thread: bounded)."""
    found: list[str] = []
    seen: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("router ready on ") and not found:
                found.append(line.split()[3])
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(READY_TIMEOUT_S) or not found:
        raise CheckFailed(f"no 'router ready on' line; it printed: {''.join(seen)[-2000:]!r}")
    return found[0]


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def check_full_set(wheels: dict[str, Path], where: Path, torch: str) -> None:
    bin_dir = venv(where)
    pip_install(bin_dir, torch)
    pip_install(bin_dir, *wheels.values())
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    for script in SCRIPTS:
        found = shutil.which(script, path=env["PATH"])
        if found is None or Path(found).parent != bin_dir:
            raise CheckFailed(f"{script} is not on the environment's PATH (found: {found})")
        run(script, "--help", env=env)
    launch = run("tspd-launch", "--help", env=env).stdout
    if "tspd-launch local" not in launch:
        raise CheckFailed(f"tspd-launch --help does not show its examples: {launch[:300]!r}")
    print(f"full set: {', '.join(SCRIPTS)} on PATH, each answers --help", flush=True)


def main() -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument(
        "--keep", type=Path, metavar="DIR", help="build in DIR and leave it (default: a temporary)"
    )
    parser.add_argument(
        "--torch", default=TORCH, metavar="SPEC", help="torch, installed first (%(default)s)"
    )
    opts = parser.parse_args()
    work = opts.keep or Path(tempfile.mkdtemp(prefix="tspd-packaging-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        wheels = build_wheels(work / "wheels")
        print(f"built {len(wheels)} wheels: {', '.join(sorted(w.name for w in wheels.values()))}")
        check_router_set(wheels, work / "router-venv")
        check_full_set(wheels, work / "full-venv", opts.torch)
    except CheckFailed as exc:
        print(f"packaging: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if opts.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"packaging: every check passed in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
