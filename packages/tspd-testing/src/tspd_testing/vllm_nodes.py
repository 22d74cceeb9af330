"""Real vLLM servers for the vLLM tests and benchmarks (``nox -s vllm``): vLLM's OpenAI
server processes (``python -m vllm.entrypoints.openai.api_server``, what ``vllm serve``
runs), with or without a KV connector, and the ``tspd-vllm front`` in front of them.

No vLLM import here: each node is a process of the caller's interpreter, started in a
session of its own so that its engine core and workers stop with it. Stopping sends SIGTERM
to that session, then SIGKILL after a bound; :meth:`VllmNode.kill` is the abrupt death
(SIGKILL at once).

CPU settings: 256 MiB of KV per node by default (``--kv-cache-memory-bytes``: 11,000 SmolLM2
tokens; five nodes and a loaded 24 GiB machine left an OOM kill at 1 GiB each) and threads
unbound (``VLLM_CPU_OMP_THREADS_BIND=nobind``, one OpenMP thread): several nodes share the
machine's cores without pinning onto the same ones.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

BIN = Path(sys.executable).parent
MODEL_NAME = "smollm2"


def free_port() -> int:
    """A port the OS considers free now (for servers whose port must be known up front)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tspd_kv_config(role: str, bootstrap_port: int = 0, **extra: object) -> dict[str, Any]:
    """``--kv-transfer-config`` for TspdConnector (role: kv_producer or kv_consumer)."""
    options: dict[str, object] = dict(extra)
    if bootstrap_port:
        options["bootstrap_port"] = bootstrap_port
    return {
        "kv_connector": "TspdConnector",
        "kv_connector_module_path": "tspd_vllm.connector",
        "kv_role": role,
        "kv_connector_extra_config": options,
    }


@dataclass
class VllmNode:
    """One ``vllm serve`` process (owned by the test or benchmark that started it)."""

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    _log: TextIO = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until ``GET /health`` answers 200; a dead process or the bound raises with its log."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)  # polling a real observable: the server's health
        raise TimeoutError(f"{self.name} not ready in {timeout_s} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL the node's whole session at once (a crash)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the node's session, SIGKILL it after ``timeout_s``; idempotent."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
            except ProcessLookupError:
                pass
        self._log.close()


def _start(name: str, cmd: list[str], log_dir: Path, env: Mapping[str, str], port: int) -> VllmNode:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True
    )
    return VllmNode(name, port, proc, log_path, log)


def start_vllm(
    name: str,
    model_dir: Path,
    log_dir: Path,
    *,
    kv_config: Mapping[str, Any] | None = None,
    tp: int = 1,
    max_model_len: int = 2048,
    kv_cache_bytes: int = 256 << 20,
    env: Mapping[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
    eager: bool = True,
) -> VllmNode:
    """Start a vLLM server on a free port (not waited for: :meth:`VllmNode.wait_ready`).

    ``eager`` (the default) skips torch.compile: a node is ready in ~30 s instead of ~100 s
    here (the compile's warm-up), with the same tokens."""
    port = free_port()
    cmd = [
        sys.executable,  # vllm-cpu's `vllm` command looks itself up as "vllm" and fails
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        MODEL_NAME,
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(max_model_len),
        "--tensor-parallel-size",
        str(tp),
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        "--disable-uvicorn-access-log",
        *(("--enforce-eager",) if eager else ()),
        *extra_args,
    ]
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(dict(kv_config))]
    full_env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        **(env or {}),
    }
    return _start(name, cmd, log_dir, full_env, port)


def start_front(
    log_dir: Path,
    prefills: list[str],
    decodes: list[str],
    flow: str = "sequential",
    name: str | None = None,
) -> VllmNode:
    """Start ``tspd-vllm front`` on a free port (wait with :meth:`VllmNode.wait_ready`);
    its log is ``<name>.log`` (default ``front-<flow>``)."""
    port = free_port()
    cmd = [str(BIN / "tspd-vllm"), "front", "--flow", flow, "--port", str(port)]
    for p in prefills:
        cmd += ["--prefill", p]
    for d in decodes:
        cmd += ["--decode", d]
    return _start(name or f"front-{flow}", cmd, log_dir, os.environ, port)


def post_json(url: str, body: Mapping[str, Any], timeout_s: float = 300.0) -> tuple[int, Any]:
    """POST a JSON body; (status, parsed answer) — an HTTP error's body too."""
    data = json.dumps(dict(body)).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode(errors="replace")


def metric(url: str, name: str) -> float | None:
    """The first sample of ``name`` in a node's ``/metrics`` (None if absent)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name) and (line[len(name)] in " {"):
                return float(line.rsplit(" ", 1)[1])
    return None
