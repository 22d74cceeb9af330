"""A real one-machine cluster for the hardening tests: ``launch_pd.py local --restart`` (prefill
node at TP 2 hosting its bootstrap server, decode node at TP 1, router; every role a process,
KV over Mooncake TCP), with what the tests ask of it: its URLs, the pids of each role and of
each node's ranks, the exact tokens of a known prompt, and whether both pools are whole.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import requests

from tspd_engine.config import EngineConfig
from tspd_engine.frames import SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_serving.openai.text import Detokenizer
from tspd_serving.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "apps" / "launch_pd.py"
TOK = ByteTokenizer()
MODEL = "tspd-tiny"
CFG = EngineConfig(num_pages=256, max_running=32)  # what the flags below set
KNOWN = "the cluster still answers"
ROLES = ("prefill", "decode", "router")


def expected_texts(prompts: list[str], max_tokens: int, ignore_eos: bool = False) -> list[str]:
    """Each prompt's greedy text on a colocated TP-1 engine (the reference)."""
    engine = Engine(CFG.replace(tp=1))
    params = SamplingParams(max_tokens, ignore_eos=ignore_eos)
    try:
        outs = engine.generate([TOK.encode(p) for p in prompts], params)
    finally:
        engine.close()
    texts = []
    for out in outs:
        d = Detokenizer()
        texts.append(d.feed(list(out.tokens)) + d.flush())
    return texts


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds it took ``check`` to hold (AssertionError after ``timeout``)."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.2)
    return time.monotonic() - start


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        children = _children(todo.pop())
        out += children
        todo += children
    return sorted(out)


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry.name))
    return sorted(out)


@dataclass
class Cluster:
    proc: subprocess.Popen[str]
    urls: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    known: str = ""  #: the known prompt's exact text

    @classmethod
    def start(cls, *extra: str) -> Cluster:
        argv = [sys.executable, str(LAUNCHER), "local", "--log-level", "warning", "--restart",
                "--router-port", "0", "--prefill-port", "0", "--decode-port", "0",
                "--bootstrap-port", "0", "--num-pages", str(CFG.num_pages),
                "--max-running", str(CFG.max_running), *extra]  # fmt: skip
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        cluster = cls(proc, known=expected_texts([KNOWN], 8)[0])
        threading.Thread(target=cluster._read, daemon=True).start()
        if not cluster.ready.wait(300):
            cluster.stop()
            raise AssertionError("\n".join(["local never got ready:", *cluster.lines]))
        return cluster

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            words = line.split()
            if len(words) == 2 and words[0] in ROLES:
                self.urls[words[0]] = words[1]
            if line.startswith("local ready on "):
                self.ready.set()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    # -- processes -----------------------------------------------------------------------

    def role_pid(self, role: str) -> int:
        """The pid of ``role``'s process now (a restarted role has a new one)."""
        for pid in _children(self.proc.pid):
            if f"launch_pd.py {role} " in _cmdline(pid):
                return pid
        raise AssertionError(f"no {role} process under local")

    def rank_pids(self, role: str) -> list[int]:
        """The rank processes of a node: its descendants named ``tspd-<p|d>-rank<r>``
        (``launch`` forks them from a forkserver, so the node's children are that server and
        the resource tracker; each rank names itself, ``tspd_core.procname``)."""
        want = f"tspd-{role[0]}-rank"
        pids = [p for p in _descendants(self.role_pid(role)) if _comm(p).startswith(want)]
        assert pids, f"{role} has no rank processes"
        return pids

    def said(self, pattern: str) -> list[str]:
        return [line for line in list(self.lines) if re.search(pattern, line)]

    # -- what the tests check ------------------------------------------------------------

    def complete(self, prompt: str, max_tokens: int, timeout: float = 60) -> requests.Response:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
        return requests.post(self.urls["router"] + "/v1/completions", json=body, timeout=timeout)

    def answers_known(self) -> bool:
        """Whether the router answers the known prompt with its exact text now."""
        try:
            resp = self.complete(KNOWN, 8, timeout=20)
        except requests.RequestException:
            return False
        return resp.status_code == 200 and resp.json()["choices"][0]["text"] == self.known

    def pools_whole(self) -> bool:
        """Both nodes idle with every page back (free, or cached prefixes nobody holds)."""
        for role in ("prefill", "decode"):
            try:
                replicas = requests.get(self.urls[role] + "/stats", timeout=10).json()["replicas"]
            except (requests.RequestException, ValueError, KeyError):
                return False
            for stats in replicas:
                busy = stats["running"] + stats["waiting"] + stats["held"]
                if busy or stats["reclaimable_pages"] != stats["initial_free_pages"]:
                    return False
        return True

    def router_metric(self, line_start: str) -> float:
        text = requests.get(self.urls["router"] + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(line_start + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def report(name: str, values: dict[str, float]) -> None:
    """Append a measured figure to $TSPD_FAULTS_REPORT (the faults session prints them)."""
    path = os.environ.get("TSPD_FAULTS_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"case": name} | values) + "\n")
