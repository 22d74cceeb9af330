"""The simulator's dependency rule (docs/ARCHITECTURE.md): it runs tspd's own planner and
scheduler but never loads torch or the transfer peers, so it stays a light numpy/SimPy tool.
Checked in a fresh interpreter, after running a small replay, so lazy imports count too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = """
import json, sys
import tspd_sim, tspd_sim.cli
from tspd_sim import traces
mods = sorted(sys.modules)
print(json.dumps([m for m in mods if m == "torch" or m.startswith(("torch.", "tspd_core.pd",
      "tspd_core.epd", "mooncake", "zmq"))]))
"""


def test_the_simulator_never_loads_torch_or_the_peers() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_a_replay_does_not_load_them_either(tmp_path: Path) -> None:
    probe = PROBE.replace(
        "mods = sorted(sys.modules)",
        "tspd_sim.cli.main(['run', '--max-requests', '40', '--no-plots', '--quiet',\n"
        "                   '--out', sys.argv[1]])\n"
        "mods = sorted(sys.modules)",
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    written = sorted(p.name for p in tmp_path.iterdir())  # it did replay the 40 requests
    assert written == [
        "held.csv", "in_system.csv", "links.csv", "pools.csv", "requests.parquet", "summary.json"
    ]  # fmt: skip
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
