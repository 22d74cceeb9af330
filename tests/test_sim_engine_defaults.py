"""The simulator sizes deployments of the reference engine behind tspd's router: a setting
both have is spelled the same (the engine's word, or the engine's word prefixed with the role
where P and D engines take different values), takes the same values, and — unless listed
below as a GPU-deployment size — has the same default, so a simulation with default flags
describes nodes and a router started with default flags."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import pytest

from tspd_core.layout import PageLayout, PlaneArrangement
from tspd_engine.config import EngineConfig
from tspd_engine.node.cliargs import add_engine_args, add_pd_args, engine_config, layerwise_interval
from tspd_router.cli import add_router_args, router_config
from tspd_router.config import RouterConfig
from tspd_serving.cliargs import add_http_args
from tspd_serving.errors import ConfigError
from tspd_sim.cli_args import add_cluster_options, build_config
from tspd_sim.cluster import EngineTuning
from tspd_sim.errors import SpecError

ROLES = ("prefill", "decode")
#: Engine settings the simulator has (per role where its field names carry the role).
SHARED_ENGINE = {
    "page_size",
    "max_prefill_tokens",
    "max_running",
    "prefix_cache",
    "page_layout",
    "arrangement",
    "num_pages",
}
#: Shared settings whose simulator default is a GPU deployment's size, not the engine's
#: CPU-sized one (what each side defaults to, and why).
SIZED_FOR_A_GPU = {
    # FlashMLA's page and the planner's DeepSeek-V3 recipe; the engine's 16 suits the CPU.
    "page_size": (64, 16),
    # SGLang's chunked-prefill size on large GPUs; the engine's 2048 keeps CPU rounds short.
    "max_prefill_tokens": (8192, 2048),
    # A D engine on an H100 batches hundreds of decodes; P holds what it prefills.
    "decode_max_running": (256, 64),
    # 0: whatever the GPU's memory holds after the weights; the engine's fixed CPU pool.
    "num_pages": (0, 1024),
}
#: A PD router's nodes (the router refuses to start without them).
PD_NODES = ["--prefill", "http://p:1", "--decode", "http://d:2"]
#: Simulator settings no engine or router flag has (what the simulator knows or models).
SIM_ONLY = {"mem_fraction", "reserve_output", "preemption"}


def _defaults(add: Callable[[argparse.ArgumentParser], None]) -> argparse.Namespace:
    return _parse(add, [])


def _parse(add: Callable[[argparse.ArgumentParser], None], argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(argv)


def _router_args(parser: argparse.ArgumentParser) -> None:
    add_router_args(parser)
    add_http_args(parser)


def _sim_fields(engine_field: str) -> list[str]:
    """The simulator's field(s) of one engine setting: its word, or its word per role."""
    names = {f.name for f in dataclasses.fields(EngineTuning)}
    if engine_field in names:
        return [engine_field]
    return [f"{role}_{engine_field}" for role in ROLES if f"{role}_{engine_field}" in names]


def test_every_shared_setting_has_the_engines_word() -> None:
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    sim = {f.name for f in dataclasses.fields(EngineTuning)}
    shared = {name for name in engine if _sim_fields(name)}
    assert shared == SHARED_ENGINE
    # Each of those is the engine's word alone, or the engine's word for both roles.
    for name in SHARED_ENGINE:
        assert _sim_fields(name) in ([name], [f"{role}_{name}" for role in ROLES]), name
    # The router's first-token setting and the engine's rounds keep their words too.
    assert "early_first_token" in sim
    assert "early_first_token" in {f.name for f in dataclasses.fields(RouterConfig)}
    # Every other simulator field is classified: nothing new escapes this test.
    covered = {s for name in SHARED_ENGINE for s in _sim_fields(name)}
    rest = sim - covered - SIM_ONLY
    assert rest == {"early_first_token", "decode_rounds", "layerwise"}


def test_shared_settings_default_alike_unless_sized_for_a_gpu() -> None:
    engine, sim = EngineConfig(), EngineTuning()
    for name in sorted(SHARED_ENGINE):
        for field in _sim_fields(name):
            ours, theirs = getattr(sim, field), getattr(engine, name)
            if field in SIZED_FOR_A_GPU:
                assert (ours, theirs) == SIZED_FOR_A_GPU[field], field
            else:
                assert ours == theirs, field
                assert type(ours) is type(theirs), field  # the same enum, not a lookalike
    assert set(SIZED_FOR_A_GPU) <= {s for n in SHARED_ENGINE for s in _sim_fields(n)}


def test_the_simulator_defaults_to_what_the_cluster_does() -> None:
    sim = EngineTuning()
    # tspd's router passes P's first token on at once (--hold-first-token turns it off).
    assert router_config(_parse(_router_args, PD_NODES)).early_first_token is True
    assert sim.early_first_token is True
    # The engine's loop admits, seeds and sends outputs between rounds; it has no other mode.
    assert sim.decode_rounds is True
    # A prefill node on a GPU streams its KV layerwise (on the CPU it sends it afterwards).
    gpu_node = _parse(lambda p: (add_engine_args(p), add_pd_args(p, "prefill")), [])
    gpu_node.device = "cuda"
    assert (layerwise_interval(gpu_node) > 0) is sim.layerwise is True
    # Token-major pages in TokenSpeed's per-field planes (issue 17).
    assert (sim.page_layout, sim.arrangement) == (PageLayout.NHD, PlaneArrangement.PER_FIELD)


def test_default_flags_give_the_default_settings() -> None:
    assert build_config(_defaults(add_cluster_options)).cluster.tuning == EngineTuning()
    assert engine_config(_defaults(add_engine_args)) == EngineConfig()


def test_the_same_flags_give_the_same_settings() -> None:
    # The engine's flags for the shared settings, given to a node and to tspd-sim alike.
    argv = ["--page-size", "32", "--max-prefill-tokens", "512", "--max-running", "8",
            "--num-pages", "300", "--page-layout", "hnd", "--no-prefix-cache"]  # fmt: skip
    engine = engine_config(_parse(add_engine_args, argv))
    sim = build_config(_parse(add_cluster_options, argv)).cluster.tuning
    for name in sorted(SHARED_ENGINE - {"arrangement"}):  # no engine flag for the planes
        for field in _sim_fields(name):
            assert getattr(sim, field) == getattr(engine, name), field
    assert (engine.page_layout, sim.page_layout) == (PageLayout.HND, PageLayout.HND)
    # A router's --hold-first-token is the simulator's too.
    held = build_config(_parse(add_cluster_options, ["--hold-first-token"])).cluster.tuning
    assert (
        held.early_first_token
        is router_config(_parse(_router_args, [*PD_NODES, "--hold-first-token"])).early_first_token
        is False
    )


@pytest.mark.parametrize(
    ("field", "text", "member"),
    [
        ("page_layout", "hnd", PageLayout.HND),
        ("page_layout", "nhd", PageLayout.NHD),
        ("arrangement", "page_major", PlaneArrangement.PAGE_MAJOR),
        ("arrangement", "per_field", PlaneArrangement.PER_FIELD),
    ],
)
def test_layouts_are_enums_and_their_strings_still_name_them(
    field: str, text: str, member: PageLayout | PlaneArrangement
) -> None:
    for config in (EngineConfig(**{field: text}), EngineTuning(**{field: text})):
        value = getattr(config, field)
        assert value is member
        assert getattr(dataclasses.replace(config), field) is member


def test_an_unknown_layout_is_refused_by_both() -> None:
    with pytest.raises(ConfigError, match=r"^page_layout must be 'nhd' or 'hnd', got 'khd'$"):
        EngineConfig(page_layout="khd")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^arrangement must be .*got 'rows'$"):
        EngineConfig(arrangement="rows")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"^page_layout 'khd': use 'nhd' or 'hnd'$"):
        EngineTuning(page_layout="khd")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"^arrangement 'rows': use 'per_field' or 'page_major'$"):
        EngineTuning(arrangement="rows")  # type: ignore[arg-type]
