"""Suite-wide test settings (every package's tests and the cross-package ones)."""

from __future__ import annotations

import pytest
from hypothesis import settings

# Hypothesis's default 200 ms deadline per example is a timing assertion: on a loaded 2-core CI
# machine a correct example can take longer and fail the run. No property test here is about
# speed (benchmarks are), so the suite turns the deadline off; print_blob lets a failure be
# replayed exactly with @reproduce_failure.
settings.register_profile("tspd", deadline=None, print_blob=True)
settings.load_profile("tspd")


# ---- parallel runs (`./nox -s tests -- -n 2 --dist loadgroup`; the default run is serial) ---
#
# Tests that start whole clusters (engine ranks, transfer workers, bootstrap servers) keep to
# one group each, so at most two such suites run at once on a small machine and a module's
# shared cluster fixture is started once, on one worker. Every other module is a group of its
# own (its module-scoped fixtures are built once). Without xdist these marks do nothing.
CLUSTER_GROUPS = {
    "tests/e2e/": "clusters",
    "tests/multihost/": "clusters",
    "tests/hardening/": "clusters",
    "tests/engine/test_engine_procs.py": "clusters",
    "tests/engine/test_engine_server.py": "clusters",
    "tests/pd/": "peers",
    "tests/reliability/": "peers",
    "tests/epd/": "peers",
    "tests/interop/": "peers",
    "tests/cuda/": "peers",
}


def _group(relpath: str) -> str:
    for prefix, group in CLUSTER_GROUPS.items():
        if relpath.startswith(prefix):
            return group
    return relpath


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            relpath = item.path.relative_to(root).as_posix()
            item.add_marker(pytest.mark.xdist_group(_group(relpath)))
