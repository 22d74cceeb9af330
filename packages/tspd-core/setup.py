"""The compiled part of tspd-core: the request scheduler's state and rules
(``tspd_core/sched/_*.pyx``, Cython 3; see docs/scheduler.md). Building from source needs a C
compiler. Each module is compiled with the digest of its source, which it checks when it is
imported (``sched/_build.py``): a stale in-place build refuses to load and says how to rebuild.
"""

import importlib.util
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).parent
SCHED = HERE / "src" / "tspd_core" / "sched"


def _build_rules():  # sched/_build.py by path: the package itself is not importable yet
    spec = importlib.util.spec_from_file_location("_tspd_sched_build", SCHED / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _extension(pyx: Path, digest: str) -> Extension:
    return Extension(
        f"tspd_core.sched.{pyx.stem}",
        [str(pyx.relative_to(HERE))],
        depends=[str(p.relative_to(HERE)) for p in sorted(SCHED.glob("*.pxd"))],
        define_macros=[("TSPD_SOURCE_SHA256", f'"{digest}"')],
        extra_compile_args=["-O2", "-Wno-unused-function", "-Wno-unreachable-code"],
    )


rules = _build_rules()
setup(
    ext_modules=cythonize(
        [_extension(pyx, rules.source_digest(pyx)) for pyx in sorted(SCHED.glob("_*.pyx"))],
        include_path=[str(HERE / "src")],
        build_dir=str(HERE / "build" / "cython"),
        compiler_directives={"language_level": "3"},
        quiet=True,
    )
)
