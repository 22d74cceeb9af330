"""The compiled part of tspd-core: a short request's life in the scheduler
(``tspd_core.sched._lives``, see ``tspd_core/sched/short.py``). Optional: where it cannot be
built the package installs without it and the scheduler takes its Python path."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tspd_core.sched._lives",
            ["src/tspd_core/sched/_lives.c"],
            extra_compile_args=[
                "-O2",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
                "-Wno-missing-field-initializers",
                "-Wno-cast-function-type",
            ],
            optional=True,
        )
    ]
)
