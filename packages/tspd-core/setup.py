"""The compiled part of tspd-core: the request scheduler's state and rules
(``tspd_core/sched/_*.pyx``, Cython 3; see docs/scheduler.md) and D's row copies
(``tspd_core/pd/transfer/_*.pyx``). Building from source needs a C compiler. Each module is
compiled with the digest of its source, which it checks when it is imported
(``sched/_build.py``): a stale in-place build refuses to load and says how to rebuild.
"""

import importlib.util
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).parent
SCHED = HERE / "src" / "tspd_core" / "sched"
#: Every folder with compiled modules (``_*.pyx``; the scheduler's share ``.pxd`` files).
NATIVE = [SCHED, HERE / "src" / "tspd_core" / "pd" / "transfer"]


def _build_rules():  # sched/_build.py by path: the package itself is not importable yet
    spec = importlib.util.spec_from_file_location("_tspd_sched_build", SCHED / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _extension(pyx: Path, digest: str) -> Extension:
    package = ".".join(pyx.parent.relative_to(HERE / "src").parts)
    return Extension(
        f"{package}.{pyx.stem}",
        [str(pyx.relative_to(HERE))],
        depends=[str(p.relative_to(HERE)) for p in sorted(pyx.parent.glob("*.pxd"))],
        define_macros=[("TSPD_SOURCE_SHA256", f'"{digest}"')],
        extra_compile_args=["-O2", "-Wno-unused-function", "-Wno-unreachable-code"],
    )


rules = _build_rules()
setup(
    ext_modules=cythonize(
        [
            _extension(pyx, rules.source_digest(pyx))
            for folder in NATIVE
            for pyx in sorted(folder.glob("_*.pyx"))
        ],
        include_path=[str(HERE / "src")],
        build_dir=str(HERE / "build" / "cython"),
        compiler_directives={"language_level": "3"},
        quiet=True,
    )
)
