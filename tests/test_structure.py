"""The import graph of tspd's own modules: no cycles, and every import runs with the layering
that docs/ARCHITECTURE.md writes down ("Layers").

The graph is read from the sources (``ast``), not by importing them, and counts every import:
top-level, inside functions and under ``TYPE_CHECKING`` alike — a cycle hidden in a function
or a type annotation is still a cycle in the design.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "tspd_core": ROOT / "packages/tspd-core/src/tspd_core",
    "tspd_bootstrap": ROOT / "packages/tspd-bootstrap/src/tspd_bootstrap",
    "tspd_sim": ROOT / "packages/tspd-sim/src/tspd_sim",
    "tspd_testing": ROOT / "packages/tspd-testing/src/tspd_testing",
    "tspd_serving": ROOT / "packages/tspd-serving/src/tspd_serving",
    "tspd_engine": ROOT / "packages/tspd-engine/src/tspd_engine",
    "tspd_router": ROOT / "packages/tspd-router/src/tspd_router",
    "tspd_launch": ROOT / "packages/tspd-launch/src/tspd_launch",
}

# The layers (docs/ARCHITECTURE.md): which of tspd's parts each part may import. A part is a
# top-level package, or a subpackage/module of tspd_core. Imports inside one part are free
# (but acyclic).
BASE = {"tspd_core.ids", "tspd_core.errors", "tspd_core.trace", "tspd_core.procname"}
MAY_IMPORT: dict[str, set[str]] = {
    "tspd_core": set(),  # the package's __init__: its version only
    "tspd_core.ids": set(),
    "tspd_core.errors": set(),
    "tspd_core.trace": set(),
    "tspd_core.procname": set(),
    "tspd_core.layout": BASE,
    "tspd_core.sched": BASE,
    "tspd_core.feed": BASE,
    "tspd_bootstrap": set(),
    "tspd_core.pd": BASE | {"tspd_core.layout", "tspd_core.sched", "tspd_bootstrap"},
    "tspd_core.epd": BASE | {"tspd_core.layout", "tspd_core.pd", "tspd_bootstrap"},
    "tspd_sim": BASE | {"tspd_core.layout", "tspd_core.sched"},
    # The harnesses of tests and benchmarks (a package of their own, not in tspd-core's wheel).
    "tspd_testing": BASE
    | {"tspd_core.layout", "tspd_core.sched", "tspd_core.pd", "tspd_bootstrap"},
    # What the router and the engine share, torch-free: it imports no other part of tspd, so
    # the router installs without the engine or tspd-core's PD half.
    "tspd_serving": set(),
    "tspd_engine": BASE
    | {
        "tspd_core.layout",
        "tspd_core.sched",
        "tspd_core.feed",
        "tspd_core.pd",
        "tspd_core.epd",
        "tspd_bootstrap",
        "tspd_serving",
    },
    # The router: the serving pieces and tspd_core's numpy-only base (trace), never the engine.
    "tspd_router": BASE | {"tspd_serving"},
    # The launcher runs every role; its trace replay reads traces and writes the per-request
    # table with the simulator's own code.
    "tspd_launch": BASE
    | {
        "tspd_core.layout",
        "tspd_core.sched",
        "tspd_core.feed",
        "tspd_core.pd",
        "tspd_core.epd",
        "tspd_bootstrap",
        "tspd_sim",
        "tspd_serving",
        "tspd_engine",
        "tspd_router",
    },
}
# Third-party packages each part may import (the standard library is always allowed). The
# planner and the scheduler stay numpy-only so the simulator stays light; the simulator, the
# router and the serving pieces never load torch, ZMQ or Mooncake.
THIRD_PARTY: dict[str, set[str]] = {
    "tspd_core": set(),
    "tspd_core.ids": set(),
    "tspd_core.errors": set(),
    "tspd_core.trace": set(),
    "tspd_core.procname": set(),
    "tspd_core.layout": {"numpy"},
    "tspd_core.sched": {"numpy"},
    "tspd_core.feed": {"numpy", "torch"},
    "tspd_bootstrap": {"aiohttp", "requests"},
    "tspd_core.pd": {"numpy", "torch", "zmq", "mooncake", "multiprocessing_logging"},
    "tspd_core.epd": {"numpy", "torch", "zmq", "mooncake"},
    "tspd_sim": {"numpy", "pandas", "simpy", "matplotlib", "tqdm", "rich", "pyarrow", "ray"},
    # interop: TokenSpeed's own runtime (the fixture) with its Mooncake and bootstrap server
    # adapted to this machine (TCP, loopback), as tests/interop and the benchmark run them.
    "tspd_testing": {"numpy", "torch", "tokenspeed", "mooncake", "aiohttp"},
    "tspd_serving": {"numpy", "aiohttp", "tokenizers", "jinja2", "gguf"},
    "tspd_engine": {"numpy", "torch", "zmq", "aiohttp", "safetensors", "tqdm", "gguf"},
    "tspd_router": {"aiohttp"},
    "tspd_launch": {"numpy", "aiohttp", "requests", "openai"},
}
# Inside tspd_core.pd the folders import downward, top to bottom (docs/ARCHITECTURE.md): a module
# may import its own folder and any folder in a lower row, never a row above nor another folder
# of its own row (prefill and decode know nothing of each other). "" is the package's __init__.
PD_LAYERS: list[set[str]] = [
    {""},  # the public API
    {"prefill", "decode"},  # each side: its peer (engine process) and its worker's half
    {"peer"},  # the engine-side peer both roles share
    {"worker"},  # the transfer worker both roles share
    {"metrics"},
    {"config"},
    {"proc", "layerwise"},  # worker-process plumbing (shared with EPD); step counter, schedule
    {"transfer"},  # the data path: Mooncake, write streams, queues, staging, byte rows
    {"wire"},  # every codec
    {"events", "status"},
    {"errors"},
]
# Cycles and layering breaks still being taken apart: none are left (issue 15 removed the last,
# pd.peer <-> pd.peer_metrics and pd.prefill -> epd). A fixed one must leave these lists, and
# nothing else may appear.
KNOWN_CYCLES: set[frozenset[str]] = set()
KNOWN_BREAKS: set[tuple[str, str]] = set()


@dataclass(frozen=True, slots=True)
class Module:
    name: str
    path: Path

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def modules() -> dict[str, Module]:
    out = {}
    for top, base in PACKAGES.items():
        # A stub with no source beside it is a compiled module's interface (sched/_pool, ...).
        stubs = [p for p in base.rglob("*.pyi") if not p.with_suffix(".py").exists()]
        for path in sorted([*base.rglob("*.py"), *stubs]):
            parts = [top, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = Module(".".join(parts), path)
    return out


def imported_names(mod: Module) -> Iterator[str]:
    """Every absolute module name ``mod`` imports (``from a import b`` yields ``a.b``, which
    :func:`resolve` trims to ``a`` when ``b`` is not a module)."""
    for node in ast.walk(ast.parse(mod.path.read_text(), str(mod.path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = mod.name.split(".")
                if not mod.is_package:
                    here.pop()
                here = here[: len(here) - (node.level - 1)]
                base = ".".join([*here, *([node.module] if node.module else [])])
            yield from (f"{base}.{alias.name}" for alias in node.names)


def resolve(name: str, known: dict[str, Module]) -> str | None:
    """The longest known module that ``name`` names or lies in; None for other packages."""
    while name not in known:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def graph() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {}
    for name, mod in known.items():
        targets = {resolve(n, known) for n in imported_names(mod)}
        edges[name] = {t for t in targets if t is not None and t != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components with more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.add(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def part(name: str) -> str:
    """The layer a module belongs to: ``tspd_core.<sub>`` or the top-level package."""
    pieces = name.split(".")
    return ".".join(pieces[:2]) if pieces[0] == "tspd_core" and len(pieces) > 1 else pieces[0]


def third_party(mod: Module) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(mod.path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names and top not in PACKAGES:
                out.add(top)
    return out


def test_the_graph_sees_every_kind_of_import() -> None:
    edges = graph()
    # Relative, absolute, from-package, function-local and TYPE_CHECKING imports all count.
    assert "tspd_core.layout.errors" in edges["tspd_core.layout.checks"]
    assert "tspd_core.layout.contract" in edges["tspd_core.layout.codec"]
    assert "tspd_sim.sim.finished" in edges["tspd_sim.metrics"]  # under TYPE_CHECKING
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    found = set(cycles(graph()))
    assert found - KNOWN_CYCLES == set(), "new import cycles"
    assert KNOWN_CYCLES - found == set(), "fixed cycles still listed in KNOWN_CYCLES"


def test_every_import_follows_the_layers() -> None:
    breaks = set()
    for name, targets in graph().items():
        mine = part(name)
        assert mine in MAY_IMPORT, f"{name}: part {mine!r} has no layer in MAY_IMPORT"
        for target in targets:
            theirs = part(target)
            if theirs != mine and theirs not in MAY_IMPORT[mine]:
                breaks.add((name, theirs))
    assert breaks - KNOWN_BREAKS == set(), "imports against the layering"
    assert KNOWN_BREAKS - breaks == set(), "fixed breaks still listed in KNOWN_BREAKS"


def pd_folder(name: str) -> str | None:
    """The folder (or top-level module) of tspd_core.pd a module is in; "" for the package."""
    pieces = name.split(".")
    if pieces[:2] != ["tspd_core", "pd"]:
        return None
    return pieces[2] if len(pieces) > 2 else ""


def test_pd_folders_import_downward() -> None:
    row = {folder: i for i, folders in enumerate(PD_LAYERS) for folder in folders}
    wrong = set()
    for name, targets in graph().items():
        mine = pd_folder(name)
        if mine is None:
            continue
        assert mine in row, f"{name}: folder {mine!r} has no row in PD_LAYERS"
        for target in targets:
            theirs = pd_folder(target)
            if theirs is not None and theirs != mine and row[theirs] <= row[mine]:
                wrong.add((name, target))
    assert wrong == set(), "imports up (or across) tspd_core.pd's folders"


def test_third_party_imports_follow_the_layers() -> None:
    wrong = {
        (mod.name, pkg)
        for mod in modules().values()
        for pkg in third_party(mod)
        if pkg not in THIRD_PARTY[part(mod.name)]
    }
    assert wrong == set()
