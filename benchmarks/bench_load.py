"""Load through the router with a standard tool: locust, headless, on loopback, bounded in time.

A fresh ``launch_pd.py local`` cluster (prefill node hosting its bootstrap server, decode node
TP 1, router; every role a process) takes ``--users`` (64) locust users, each sending
completions back to back (16 prompts in turn, ``--prompt-words`` (0) filler words longer,
``--max-tokens`` (16) tokens each, EOS ignored) for ``--seconds`` (60). ``--model``:
``tiny`` (the seeded model; P at TP 2) or ``smollm2-135m`` (P at TP 3). Every answer's
token ids (``return_token_ids``) are checked against the colocated engine's: different ids
are a locust failure, as is any status but 200.

Reported: requests, failures (must be 0 below the nodes' capacity) and the failures by
status and error code (``HTTP 429 overloaded``: a busy cluster's back-pressure; ``HTTP 502``/
``503``: a node taken for dead), requests per second, p50 / p99 latency (locust's), and the
resident memory (RSS) and open file descriptors of every process of the cluster (router,
nodes, rank processes, transfer workers) after a warm-up run (the baseline, same users,
``--warmup`` s) and after the measured run: the ratio after/before is the growth a leak would
show (1.0 = none); ``--warmup 0`` measures a fresh cluster's first load. ``--quick``: 16
users, 10 s. ``--max-queued-requests`` and
``--max-running`` go to both nodes (0: the nodes' default capacity, 2 × max-running).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from common import table

from tspd_engine.config import EngineConfig
from tspd_engine.frames import SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_serving.hf_tokenizer import load_tokenizer
from tspd_serving.models import SMOLLM2, model_name, resolve

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ROOT / "apps" / "launch_pd.py"
PROMPTS = [f"load test prompt {i}: " + "tspd " * (i % 6) for i in range(16)]
#: What ``--prompt-words`` repeats after each prompt's own start (so no two share a prefix page).
FILLER = "the prefill node reads this sentence once more. "
MODELS = ("tiny", SMOLLM2)
LOCUSTFILE = textwrap.dedent(
    """
    import itertools, json, os
    from locust import HttpUser, constant, task

    SETUP = json.loads(os.environ["TSPD_LOAD_SETUP"])
    CASES = itertools.cycle(SETUP["cases"])

    class Client(HttpUser):
        wait_time = constant(0)

        @task
        def complete(self):
            prompt, want = next(CASES)
            body = {"model": SETUP["model"], "prompt": prompt, "max_tokens": len(want),
                    "ignore_eos": True, "return_token_ids": True}
            with self.client.post("/v1/completions", json=body, catch_response=True,
                                  name="/v1/completions") as resp:
                if resp.status_code != 200:
                    try:
                        code = resp.json()["error"]["code"]
                    except Exception:
                        code = "?"
                    resp.failure(f"HTTP {resp.status_code} {code}")
                elif resp.json()["choices"][0]["token_ids"] != want:
                    resp.failure("HTTP 200 wrong tokens")
    """
)


def _cases(
    checkpoint: Path | None, max_tokens: int, words: int
) -> list[tuple[list[int], list[int]]]:
    """Each prompt (``words`` filler words longer) as token ids, and its greedy continuation
    on a colocated TP-1 engine."""
    tok = load_tokenizer(checkpoint)
    filler = " ".join((FILLER * (words // 8 + 1)).split()[:words])
    prompts = [tok.encode(p + filler) for p in PROMPTS]
    engine = Engine(EngineConfig(checkpoint=checkpoint, num_pages=1024, max_running=32))
    try:
        outs = engine.generate(prompts, SamplingParams(max_tokens, ignore_eos=True))
    finally:
        engine.close()
    return [(p, list(out.tokens)) for p, out in zip(prompts, outs, strict=True)]


def _start_local(opts: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    argv = [sys.executable, str(LAUNCHER), "local", "--log-level", "warning",
            "--router-port", "0", "--prefill-port", "0", "--decode-port", "0",
            "--bootstrap-port", "0", "--num-pages", "1024",
            "--max-running", str(opts.max_running)]  # fmt: skip
    if opts.max_queued_requests:  # (0: the nodes' default; a launcher before it had none)
        argv += ["--max-queued-requests", str(opts.max_queued_requests)]
    if opts.model != "tiny":
        argv += ["--model", opts.model]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("local ready on "):
            url = line.split()[3]
            threading.Thread(target=lambda: [None for _ in proc.stdout or ()], daemon=True).start()
            return proc, url
    raise SystemExit("local exited before it was ready")


def _tree(pid: int) -> dict[int, str]:
    """Every live process below ``pid``, with a short name (role or kind)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            words = [w.decode(errors="replace") for w in cmd]
            role = next((w for w in words if w in ("prefill", "decode", "router")), "")
            out[child] = role or ("resource tracker" if "resource_tracker" in " ".join(words)
                                  else "rank or worker")  # fmt: skip
            todo.append(child)
    return out


def _usage(pids: dict[int, str]) -> dict[int, tuple[int, int]]:
    """RSS (KiB) and open fds of each live pid."""
    out = {}
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            rss = int(next(line.split()[1] for line in status.splitlines()
                           if line.startswith("VmRSS:")))  # fmt: skip
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, StopIteration):
            continue
        out[pid] = (rss, fds)
    return out


def _locust(url: str, users: int, seconds: int, setup: dict[str, Any], out: Path) -> dict[str, Any]:
    locustfile = out / "locustfile.py"
    locustfile.write_text(LOCUSTFILE)
    prefix = out / f"run{seconds}"
    argv = [sys.executable, "-m", "locust", "-f", str(locustfile), "--headless",
            "--users", str(users), "--spawn-rate", str(users), "--run-time", f"{seconds}s",
            "--host", url, "--csv", str(prefix), "--only-summary", "--stop-timeout", "30",
            "--loglevel", "WARNING"]  # fmt: skip
    env = dict(os.environ, TSPD_LOAD_SETUP=json.dumps(setup))
    subprocess.run(argv, env=env, check=False, timeout=seconds + 120,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    with open(f"{prefix}_stats.csv") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    agg = rows["Aggregated"]
    return {
        "requests": int(agg["Request Count"]),
        "failures": int(agg["Failure Count"]),
        "failures_by_status": _failures(Path(f"{prefix}_failures.csv")),
        "rps": float(agg["Requests/s"]),
        "p50_ms": float(agg["50%"]),
        "p99_ms": float(agg["99%"]),
    }


def _failures(path: Path) -> dict[str, int]:
    """Locust's failures by their message (``HTTP <status> <code>``)."""
    counts: Counter[str] = Counter()
    if path.exists():
        with open(path) as f:
            for row in csv.DictReader(f):
                message, at = row["Error"], row["Error"].find("HTTP ")
                what = message[at:].rstrip("')\"") if at >= 0 else message  # not an HTTP answer
                counts[what] += int(row["Occurrences"])
    return dict(sorted(counts.items()))


#: What a skipped warm-up (``--warmup 0``: a fresh cluster's first load) reports.
_NONE: dict[str, Any] = {"requests": 0, "failures": 0}


def run(args: list[str]) -> dict[str, object]:
    parser = argparse.ArgumentParser(prog="bench load", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", choices=MODELS, default="tiny")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=0,
                        help="words added to each prompt (longer prefill rounds)")  # fmt: skip
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--max-queued-requests", type=int, default=0)
    opts = parser.parse_args(args)
    users, seconds, warmup = opts.users, opts.seconds, opts.warmup
    if opts.quick:
        users, seconds, warmup = 16, 10, 5
    checkpoint = None if opts.model == "tiny" else resolve(opts.model)
    cases = _cases(checkpoint, opts.max_tokens, opts.prompt_words)
    setup = {"model": model_name(checkpoint), "cases": cases}
    proc, url = _start_local(opts)
    try:
        with tempfile.TemporaryDirectory(prefix="tspd-load-") as tmp:
            warm = _locust(url, users, warmup, setup, Path(tmp)) if warmup else _NONE
            pids = _tree(proc.pid)
            before = _usage(pids)
            measured = _locust(url, users, seconds, setup, Path(tmp))
            after = _usage(pids)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(120)
    rows, processes = [], []
    for pid, name in sorted(pids.items(), key=lambda kv: kv[1]):
        if pid not in before or pid not in after:
            continue
        (rss0, fd0), (rss1, fd1) = before[pid], after[pid]
        rows.append([name, pid, rss0 // 1024, rss1 // 1024, rss1 / rss0, fd0, fd1])
        processes.append({"name": name, "pid": pid, "rss_kib": [rss0, rss1], "fds": [fd0, fd1]})
    lengths = sorted(len(p) for p, _ in cases)
    print(f"locust, {opts.model}, {users} users, {seconds} s, prompts of {lengths[0]}-"
          f"{lengths[-1]} tokens, {opts.max_tokens} tokens each "
          f"(after a {warmup} s warm-up, {warm['requests']} requests, {warm['failures']} "
          "failures)")  # fmt: skip
    by_status = ", ".join(f"{k}: {v}" for k, v in measured["failures_by_status"].items())
    print(table(["requests", "failures", "by status", "req/s", "p50 ms", "p99 ms"],
                [[measured["requests"], measured["failures"], by_status or "-",
                  measured["rps"], measured["p50_ms"], measured["p99_ms"]]]))  # fmt: skip
    print()
    print(table(["process", "pid", "RSS MiB before", "after", "after/before", "fds before",
                 "after"], rows))  # fmt: skip
    return {"model": opts.model, "users": users, "seconds": seconds,
            "max_tokens": opts.max_tokens, "prompt_words": opts.prompt_words, "warmup": warm,
            "measured": measured, "processes": processes}  # fmt: skip
