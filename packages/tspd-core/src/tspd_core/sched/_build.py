"""Which source a compiled module was built from (shared by setup.py and the modules).

``setup.py`` compiles each ``sched/_*.pyx`` and ``pd/transfer/_*.pyx`` with the digest of its
source (the ``.pyx`` and every ``.pxd`` beside it, which it may cimport) and each module
checks, as it is imported, that the source beside it still has that digest. The in-place
build is git-ignored, so without the check a test run after an edit of a ``.pyx`` would
quietly run the old binary.

Standard library only: ``setup.py`` loads this file by path, before anything is installed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

#: How to rebuild, for the error message (the editable install recompiles every module).
REBUILD = "pip install -e packages/tspd-core (or ./nox -s tests, which rebuilds when it changes)"


def source_digest(pyx: Path) -> str:
    """SHA-256 over the names and bytes of ``pyx`` and every ``.pxd`` in its folder."""
    digest = hashlib.sha256()
    for path in [pyx, *sorted(pyx.parent.glob("*.pxd"))]:
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def check_built_from(
    module_file: str, name: str, built_from: str, package: str = "tspd_core.sched"
) -> None:
    """Refuse (``ImportError``) a compiled module whose source beside it has changed since it
    was built. An install without the sources (a wheel) has nothing to compare: it passes."""
    pyx = Path(module_file).with_name(f"{name}.pyx")
    if not pyx.is_file():
        return
    now = source_digest(pyx)
    if now != built_from:
        raise ImportError(
            f"{package}.{name} is stale: it was built from another version of {pyx} "
            f"(built from sha256 {built_from[:12] or 'unknown'}, the source is now "
            f"{now[:12]}); rebuild it: {REBUILD}"
        )
