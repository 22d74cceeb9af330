"""The simulator sizes deployments of the reference engine: where both have the same setting,
a simulation with default flags describes nodes started with default flags."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from tspd_engine.config import EngineConfig
from tspd_engine.node.cliargs import add_engine_args
from tspd_sim.cli_args import add_cluster_options, build_config
from tspd_sim.cluster import EngineTuning


def _defaults(add: Callable[[argparse.ArgumentParser], None]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args([])


def test_the_simulator_and_the_engine_default_to_token_major_pages() -> None:
    # Token-major (NHD) is what a tspd node uses unless started with --page-layout hnd, and
    # TokenSpeed's only order (issue 17); the simulator's tuning, its CLI and the engine's
    # config and CLI must not drift apart again.
    assert EngineConfig().page_layout == "nhd"
    assert _defaults(add_engine_args).page_layout == "nhd"
    assert EngineTuning().page_layout == "nhd"
    sim = build_config(_defaults(add_cluster_options))
    assert sim.cluster.tuning.page_layout == "nhd"
