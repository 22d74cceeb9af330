"""The compiled scheduler refuses to load when its source changed since it was built (the
in-place build is git-ignored: without the check a test run would quietly use the old one)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tspd_core
from tspd_core.sched import _build

SRC = Path(tspd_core.__file__).parent
MODULES = ("_pool", "_prefix", "_slots", "_lifecycle", "_rounds")


def test_every_module_was_built_from_the_source_beside_it() -> None:
    # Imported already (tspd_core.sched loads all five); their check passed. Say so exactly:
    # each .so sits next to its .pyx, so the check compared against the real source.
    for name in MODULES:
        module = sys.modules[f"tspd_core.sched.{name}"]
        assert Path(module.__file__ or "").parent == SRC / "sched"
        assert (SRC / "sched" / f"{name}.pyx").is_file()


def test_the_check_compares_the_source_and_every_pxd(tmp_path: Path) -> None:
    (tmp_path / "_m.pyx").write_text("x = 1\n")
    (tmp_path / "_m.pxd").write_text("cdef int y\n")
    built = _build.source_digest(tmp_path / "_m.pyx")
    so = str(tmp_path / "_m.cpython-311-x86_64-linux-gnu.so")
    _build.check_built_from(so, "_m", built)
    (tmp_path / "_other.pxd").write_text("# a pxd it may cimport\n")
    with pytest.raises(ImportError, match="pip install -e packages/tspd-core") as info:
        _build.check_built_from(so, "_m", built)
    assert "tspd_core.sched._m is stale" in str(info.value)
    assert "./nox -s tests" in str(info.value)
    (tmp_path / "_m.pyx").unlink()  # an install without sources (a wheel): nothing to check
    _build.check_built_from(so, "_m", "anything")


def _import_copy(root: Path) -> subprocess.CompletedProcess[str]:
    code = "import tspd_core.sched as s; print(s.RequestScheduler.__module__, s.__file__)"
    return subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_an_edited_source_makes_the_built_module_refuse_to_load(tmp_path: Path) -> None:
    # A copy of the installed package with its compiled modules, imported first on the path.
    copy = tmp_path / "tspd_core"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__", "pd", "epd"))
    fine = _import_copy(tmp_path)
    assert fine.returncode == 0, fine.stderr
    assert str(copy / "sched" / "__init__.py") in fine.stdout
    with (copy / "sched" / "_slots.pyx").open("a") as f:
        f.write("\n# edited after the build\n")
    stale = _import_copy(tmp_path)
    assert stale.returncode == 1
    assert "ImportError: tspd_core.sched._slots is stale" in stale.stderr
    assert "pip install -e packages/tspd-core" in stale.stderr
    (copy / "sched" / "_slots.pyx").unlink()  # no source beside the module: loads
    assert _import_copy(tmp_path).returncode == 0
