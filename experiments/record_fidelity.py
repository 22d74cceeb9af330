"""Record the real runs notebook 04 compares the simulator with (issue 19, "fidelity against
the real thing"): ``python experiments/record_fidelity.py`` (about 10-12 minutes here).

1. Start ``launch_pd.py local`` serving SmolLM2-135M-Instruct (P TP 1 -> D TP 1 by default,
   both nodes writing their step logs: ``--step-logs``).
2. **Calibration run**: replay one window of the Azure conversation trace (``--cal-start``)
   and fit the simulator's step-time model on the rounds the nodes logged during it
   (``tspd-sim calibrate``): the calibration sees the machine as loaded as the runs it
   predicts, but none of their requests.
3. **Runs**: replay another window (``--start``, ``--requests``) at each of ``--rates``
   (light, medium, near saturation), the same requests each time, arrivals rescaled.
4. Stop the cluster. Write under ``--out`` (default ``experiments/data/04_fidelity``):
   ``calibration.json``, ``calibration_prefill.csv`` / ``calibration_decode.csv`` (the step
   log lines of the calibration run), ``calibration_requests.csv``, and per rate
   ``real_<label>.csv`` (the replay's per-request table), ``real_<label>.json`` (its
   report: wall-clock window, load average before and after, send lag) and
   ``real_<label>_{prefill,decode}.csv`` (the step log lines of its window), and ``meta.json``
   (the commands, the cluster, the commit, the machine's load average at the start and end).

Every step is one of the documented commands (``launch_pd.py local``, ``launch_pd.py
replay``, ``tspd-sim calibrate``), printed as it runs. The machine's load moves the real
figures; the load averages recorded beside each run say how loaded it was.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LAUNCHER = ROOT / "apps" / "launch_pd.py"
DATA = HERE / "data" / "04_fidelity"
LABELS = ("light", "medium", "high")


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    if len(ns.rates) != 3:
        raise SystemExit("--rates takes three rates: light, medium, near saturation")
    ns.out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, object] = {
        "commit": _git("rev-parse", "HEAD"),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg_start": os.getloadavg(),
        "cluster": {
            "model": ns.model,
            "prefill_tp": ns.prefill_tp,
            "decode_tp": ns.decode_tp,
            "num_pages": ns.num_pages,
            "page_size": 16,
            "max_prefill_tokens": ns.max_prefill_tokens,
        },
        "trace": {
            "name": ns.trace,
            "cal_start_s": ns.cal_start,
            "start_s": ns.start,
            "requests": ns.requests,
            "input_scale": ns.input_scale,
            "output_scale": ns.output_scale,
        },
        "rates": dict(zip(LABELS, ns.rates, strict=True)),
        "commands": [],
    }
    with tempfile.TemporaryDirectory(prefix="tspd-fidelity-") as tmp:
        logs = Path(tmp) / "steps"
        cluster = _start(ns, logs, meta)
        try:
            url = cluster.url
            # Each run its own prompt seed: the same prompts again would hit the nodes' prefix
            # caches (the trace has no prefix ids: the simulator sees no hits).
            cal = _replay(ns, url, ns.cal_start, ns.cal_rate, Path(tmp) / "cal", meta, seed=100)
            _cut_logs(logs, cal, ns.out, "calibration")
            _calibrate(ns, meta)
            _copy_table(Path(tmp) / "cal" / "requests.csv", ns.out / "calibration_requests.csv")
            for k, (label, rate) in enumerate(zip(LABELS, ns.rates, strict=True)):
                report = _replay(ns, url, ns.start, rate, Path(tmp) / label, meta, seed=10 * k)
                _cut_logs(logs, report, ns.out, f"real_{label}")
                _copy_table(Path(tmp) / label / "requests.csv", ns.out / f"real_{label}.csv")
                (ns.out / f"real_{label}.json").write_text(json.dumps(report, indent=2) + "\n")
        finally:
            cluster.stop()
    meta["loadavg_end"] = os.getloadavg()
    meta["ended"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (ns.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {ns.out}/")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="smollm2-135m", help="the nodes' --model")
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--num-pages", type=int, default=1024)
    p.add_argument("--max-prefill-tokens", type=int, default=64,
                   help="the nodes' prefill budget per round: a node answers its health probe "
                        "between rounds, up to two rounds late, and reports its engine stalled "
                        "after 5 s (the router then takes it out): on a loaded CPU a 128-token "
                        "round took up to 3.7 s")  # fmt: skip
    p.add_argument("--trace", default="azure-conv")
    p.add_argument("--cal-start", type=float, default=600.0, help="calibration window (s)")
    p.add_argument("--cal-rate", type=float, default=0.6, help="calibration run's req/s")
    p.add_argument("--start", type=float, default=1800.0, help="the runs' window (s)")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--rates", type=float, nargs="+", default=[0.2, 0.4, 0.65],
                   help="light, medium, near saturation (req/s)")  # fmt: skip
    p.add_argument("--input-scale", type=float, default=1 / 16)
    p.add_argument("--output-scale", type=float, default=1 / 16)
    p.add_argument("--out", type=Path, default=DATA)
    return p


class Cluster:
    """The ``local`` launcher process; ``url`` is its router once ready."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)  # fmt: skip
        self.url = ""
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            print(f"  | {line.rstrip()}", flush=True)
            if line.startswith("local ready on "):
                self.url = line.split()[3]
                self.ready.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _start(ns: argparse.Namespace, logs: Path, meta: dict[str, object]) -> Cluster:
    argv = [sys.executable, str(LAUNCHER), "local", "--log-level", "warning",
            "--model", ns.model, "--prefill-tp", str(ns.prefill_tp),
            "--decode-tp", str(ns.decode_tp), "--num-pages", str(ns.num_pages),
            "--max-prefill-tokens", str(ns.max_prefill_tokens),
            "--step-logs", str(logs), *(x for r in ("router", "prefill", "decode", "bootstrap")
                                        for x in (f"--{r}-port", "0"))]  # fmt: skip
    _say(argv, meta)
    cluster = Cluster(argv)
    if not cluster.ready.wait(600):
        cluster.stop()
        raise SystemExit("the cluster did not get ready in 600 s")
    return cluster


def _replay(
    ns: argparse.Namespace,
    url: str,
    start: float,
    rate: float,
    out: Path,
    meta: dict[str, object],
    seed: int,
) -> dict[str, object]:
    argv = [sys.executable, str(LAUNCHER), "replay", "--url", url, "--trace", ns.trace,
            "--start", str(start), "--requests", str(ns.requests), "--rate", str(rate),
            "--input-scale", str(ns.input_scale), "--output-scale", str(ns.output_scale),
            "--seed", str(seed), "--warmup", "2", "--out", str(out / "requests.csv"),
            "--quiet"]  # fmt: skip
    _say(argv, meta)
    done = subprocess.run(argv, check=False)
    if done.returncode not in (0, 1):  # 1: some requests failed (recorded in the table)
        raise SystemExit(f"the replay failed (exit code {done.returncode})")
    report: dict[str, object] = json.loads((out / "replay.json").read_text())
    return report


def _cut_logs(logs: Path, report: dict[str, object], out: Path, name: str) -> None:
    """Each node's step log lines of one run's window (``<name>_prefill.csv`` ...)."""
    lo, hi = float(report["started_unix"]), float(report["ended_unix"])  # type: ignore[arg-type]
    for role in ("prefill", "decode"):
        with (logs / f"{role}.csv").open() as src:
            rows = list(csv.reader(src))
        kept = [rows[0], *(r for r in rows[1:] if lo <= float(r[0]) <= hi)]
        with (out / f"{name}_{role}.csv").open("w", newline="") as dst:
            csv.writer(dst, lineterminator="\n").writerows(kept)
        print(f"  {role}: {len(kept) - 1} of {len(rows) - 1} logged rounds in run {name}")


def _calibrate(ns: argparse.Namespace, meta: dict[str, object]) -> None:
    logs = [str(ns.out / f"calibration_{role}.csv") for role in ("prefill", "decode")]
    out = str(ns.out / "calibration.json")
    argv = [sys.executable, "-m", "tspd_sim.cli", "calibrate", *logs,
            "--model", str(DATA / "smollm2-135m.toml"), "--gpu", "cpu",
            "--gpu-spec", str(DATA / "cpu.toml"), "-o", out]  # fmt: skip
    _say(argv, meta)
    subprocess.run(argv, check=True)


def _copy_table(src: Path, dst: Path) -> None:
    dst.write_text(src.read_text())


def _say(argv: list[str], meta: dict[str, object]) -> None:
    shown = " ".join(shlex.quote(a) for a in argv).replace(sys.executable, "python")
    shown = shown.replace(str(ROOT) + "/", "")
    print(f"$ {shown}", flush=True)
    commands = meta["commands"]
    assert isinstance(commands, list)
    commands.append(shown)


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip()


if __name__ == "__main__":
    raise SystemExit(main())
