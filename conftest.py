"""Suite-wide test settings (every package's tests and the cross-package ones)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from xdist.scheduler import LoadScopeScheduling

# Hypothesis's default 200 ms deadline per example is a timing assertion: on a loaded 2-core CI
# machine a correct example can take longer and fail the run. No property test here is about
# speed (benchmarks are), so the suite turns the deadline off; print_blob lets a failure be
# replayed exactly with @reproduce_failure.
settings.register_profile("tspd", deadline=None, print_blob=True)
settings.load_profile("tspd")


# ---- heavy and deploy tests -------------------------------------------------------------------
#
# A test marked ``heavy`` runs a real model's cluster for long (SmolLM2 at its context length:
# minutes of CPU; SmolLM2 behind SGLang's gateway: ~30 s), or holds a cluster past its timeouts
# (the multi-host partitions: ~65 s): the README's test command skips it to stay within its
# time, `nox -s faults` runs it. One
# marked ``deploy`` runs a real Prometheus (Debian's package) or Ray cluster for minutes:
# skipped the same way, run by `nox -s deploy`.


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-heavy", action="store_true", help="also run the tests marked heavy (nox -s faults)"
    )
    parser.addoption(
        "--run-deploy",
        action="store_true",
        help="also run the tests marked deploy (nox -s deploy)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for marker, option, session in (("heavy", "--run-heavy", "faults"),
                                    ("deploy", "--run-deploy", "deploy")):  # fmt: skip
        if config.getoption(option):
            continue
        skip = pytest.mark.skip(reason=f"{marker}: runs with {option} (nox -s {session})")
        for item in items:
            if item.get_closest_marker(marker) is not None:  # not keywords: tests/deploy/
                item.add_marker(skip)


# ---- parallel runs (`-n 2 --dist loadgroup`) ---------------------------------------------------
#
# `./nox -s tests` runs two workers. Modules that start whole clusters (engine ranks, transfer
# workers, bootstrap servers, routers) form two groups, the peers' multi-process tests a third,
# so at most two clusters run at once and a module's shared fixture is started once, on one
# worker; every other module is a group of its own. A cluster test spends most of its time
# waiting (timeouts, health intervals, other processes' rounds: a run uses about a third of two
# cores), so the second cluster group — the attacks, each a short cluster of its own — runs
# beside the first instead of after it. The modules that start one node or
# one replica at a time (the launcher's CLI, the bootstrap role, the engine's processes) are
# groups of their own too: they balance the two workers (the cluster group is the longer).
# Without xdist none of this applies.
CLUSTER_GROUPS = {
    "tests/multihost/": "clusters",
    "tests/e2e/test_real_model_pd.py": "clusters",
    "tests/e2e/test_openai_local.py": "clusters",
    "tests/e2e/test_pd_engine.py": "clusters",
    "tests/e2e/test_replay.py": "clusters",
    "tests/e2e/test_kill_prefill.py": "clusters",
    "tests/hardening/test_cluster_doors.py": "clusters",
    "tests/hardening/test_faults.py": "clusters",
    "tests/hardening/test_node_overload.py": "clusters",
    "tests/hardening/test_refused_rooms.py": "attacks",
    "tests/hardening/test_router_attacks.py": "attacks",
    "tests/hardening/test_forged_rank.py": "attacks",
    "tests/e2e/test_sglang_gateway": "attacks",  # and its _smollm2 twin: short clusters
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


#: Scopes handed out first, in this order: the longest (seconds of a quiet run: clusters ~270,
#: peers ~115, attacks ~55, then single modules of 8-25 s). xdist orders scopes by their number
#: of tests, which left a long scope of few tests (the attacks) to the end: one worker ran it
#: alone for the run's last half minute.
LONGEST_FIRST = (
    "clusters",
    "peers",
    "attacks",
    "tests/hardening/test_engine_doors.py",
    "tests/hardening/test_node_api_fuzz.py",
    "tests/models/test_smollm2_reference.py",
    "tests/e2e/test_bootstrap_roles.py",
    "tests/e2e/test_launcher_cli.py",
)


class _GroupScheduling(LoadScopeScheduling):
    """``--dist loadgroup`` by module path: a scope is `_group` of the test's file. (xdist 3.8
    marks a group by appending ``@name`` to ``item._nodeid``, which pytest 9 no longer reads, so
    ``xdist_group`` marks alone would leave every test a scope of its own: module fixtures set up
    once per worker and two clusters side by side.) The scopes of ``LONGEST_FIRST`` go out
    first, so that the run ends on short ones."""

    _ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return _group(nodeid.split("::", 1)[0])

    def _assign_work_unit(self, node: Any) -> None:
        if not self._ordered:  # the first hand-out: the work queue is complete
            self._ordered = True
            for scope in reversed(LONGEST_FIRST):
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
        super()._assign_work_unit(node)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LoadScopeScheduling | None:
    if config.getvalue("dist") != "loadgroup":
        return None  # xdist's own scheduler for the mode asked for
    return _GroupScheduling(config, log)  # type: ignore[arg-type]
