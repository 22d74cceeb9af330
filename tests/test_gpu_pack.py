"""scripts/gpu_pack.py's pure parts: a byte-reproducible archive, and the refusals (the
downloads and the ELF walk run in ``scripts/gpu-pack`` itself, which checks every pin)."""

from __future__ import annotations

import importlib.util
import os
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_pack.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_pack", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tree(root: Path, mtime: int) -> None:
    (root / "site" / "pkg").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "site" / "pkg" / "__init__.py").write_text("x = 1\n")
    (root / "lib" / "libz.so.1").write_bytes(b"\x7fELF" + bytes(60))
    for path in root.rglob("*"):
        os.utime(path, (mtime, mtime))


def test_the_same_files_make_the_same_archive_bytes(tmp_path: Path) -> None:
    pack = _load()
    a, b = tmp_path / "a", tmp_path / "b"
    _tree(a, 1_000_000)
    _tree(b, 2_000_000)  # other times: not part of the archive
    pack.archive(a, tmp_path / "a.tar.gz")
    pack.archive(b, tmp_path / "b.tar.gz")
    assert (tmp_path / "a.tar.gz").read_bytes() == (tmp_path / "b.tar.gz").read_bytes()
    with tarfile.open(tmp_path / "a.tar.gz") as tar:
        members = [(m.name, m.mode, m.mtime, m.uid) for m in tar.getmembers()]
    assert members == [
        ("lib", 0o755, 0, 0),
        ("lib/libz.so.1", 0o755, 0, 0),
        ("site", 0o755, 0, 0),
        ("site/pkg", 0o755, 0, 0),
        ("site/pkg/__init__.py", 0o644, 0, 0),
    ]


def test_a_link_in_the_pack_is_refused(tmp_path: Path) -> None:
    pack = _load()
    _tree(tmp_path / "p", 0)
    (tmp_path / "p" / "lib" / "libz.so").symlink_to("libz.so.1")
    with pytest.raises(pack.PackError, match=r"libz\.so: a link in the pack"):
        pack.archive(tmp_path / "p", tmp_path / "out.tar.gz")
