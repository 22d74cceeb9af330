"""Execute the experiment notebooks headless: `python experiments/run.py [name ...]`.

Every notebook under ``experiments/`` (or the ones named, with or without ``.ipynb``) runs top
to bottom in a fresh kernel of **this** interpreter (a private kernelspec pointing at
``sys.executable``, so the run never depends on which Jupyter kernels a machine has
installed), with ``experiments/`` as the working directory. A cell that raises fails its
notebook; the run goes on with the next notebook and exits 1 if any failed, printing the
failing cell's error. The notebooks write their figures to ``experiments/figures/``.

The committed notebooks carry no outputs (the PNGs and docs/experiments.md are the durable
results). Executed copies, with outputs, go to ``experiments/executed/`` (not committed);
``--inplace`` writes the outputs back into the notebooks instead, and ``--strip`` only removes
the outputs of the named notebooks (no execution) before a commit.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

HERE = Path(__file__).resolve().parent
EXECUTED = HERE / "executed"
KERNEL = "tspd-experiments"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def notebooks(names: list[str]) -> list[Path]:
    """The notebooks to run: all of ``experiments/*.ipynb`` (sorted) or the named ones."""
    found = sorted(HERE.glob("*.ipynb"))
    if not names:
        return found
    by_name = {p.stem: p for p in found}
    picked, unknown = [], []
    for name in names:
        stem = Path(name).name.removesuffix(".ipynb")
        (picked.append(by_name[stem]) if stem in by_name else unknown.append(name))
    if unknown:
        raise SystemExit(f"unknown notebook(s) {unknown}; available: {sorted(by_name)}")
    return picked


def kernel_manager(spec_root: Path) -> KernelManager:
    """A kernel manager whose only kernelspec runs ipykernel in this interpreter."""
    spec_dir = spec_root / "kernels" / KERNEL
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "tspd experiments (this interpreter)",
        "language": "python",
        # Headless plotting; no fork warnings from a kernel with its own threads.
        "env": {"MPLBACKEND": "Agg", "PYTHONWARNINGS": "ignore::DeprecationWarning"},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(spec_root / "kernels")], ensure_native_kernel=False)
    # IPC sockets in the private directory: local only, no TCP ports to pick or expose.
    return KernelManager(
        kernel_name=KERNEL,
        kernel_spec_manager=specs,
        transport="ipc",
        ip=str(spec_root / "kernel"),
    )


def execute(path: Path, spec_root: Path, timeout: int) -> tuple[nbformat.NotebookNode, str]:
    """Run one notebook; return it (with outputs) and an error text ('' on success)."""
    nb = _read(path)
    client = NotebookClient(
        nb,
        km=kernel_manager(spec_root),
        timeout=timeout,
        resources={"metadata": {"path": str(HERE)}},
    )
    try:
        # A client shuts down only kernels it created; this one was handed a manager, so ask.
        client.execute(cleanup_kc=True)
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as exc:
        return nb, _ANSI.sub("", str(exc))
    return nb, ""


def _read(path: Path) -> nbformat.NotebookNode:
    nb: nbformat.NotebookNode = nbformat.read(path, as_version=4)  # type: ignore[no-untyped-call]
    return nb


def _write(nb: nbformat.NotebookNode, path: Path) -> None:
    nbformat.write(nb, path)  # type: ignore[no-untyped-call]


def strip(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Remove outputs and execution counts (the committed form)."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebooks to run (default: all)")
    parser.add_argument(
        "--timeout", type=int, default=900, help="seconds one cell may run (default 900)"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--inplace", action="store_true", help="store outputs in the notebooks")
    mode.add_argument("--strip", action="store_true", help="strip outputs only; run nothing")
    opts = parser.parse_args(argv)
    paths = notebooks(opts.names)
    if not paths:
        raise SystemExit(f"no notebooks under {HERE}")
    if opts.strip:
        for path in paths:
            _write(strip(_read(path)), path)
            print(f"stripped {path.name}")
        return 0
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tspd-kernel-") as tmp:
        for path in paths:
            print(f"=== {path.name}", flush=True)
            started = time.perf_counter()
            nb, error = execute(path, Path(tmp), opts.timeout)
            wall = time.perf_counter() - started
            out = path if opts.inplace else EXECUTED / path.name
            out.parent.mkdir(exist_ok=True)
            _write(nb, out)
            status = "FAILED" if error else "ok"
            print(f"    {status} in {wall:.0f} s -> {out.relative_to(HERE.parent)}", flush=True)
            if error:
                print(error, file=sys.stderr)
                failed.append(path.name)
    if failed:
        print(f"{len(failed)} of {len(paths)} notebooks failed: {failed}", file=sys.stderr)
        return 1
    print(f"all {len(paths)} notebooks ran")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
