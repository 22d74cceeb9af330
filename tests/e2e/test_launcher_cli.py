"""``launch_pd.py`` as a new user meets it: the manual, and clear one-line refusals that start
nothing.

The manual is read once from a real ``launch_pd.py`` process (the script as a user runs it);
the refusals call the launcher's ``main`` in this process — each is refused before any role
starts, so a process per case would only pay torch's import again — and check that the
process tree is unchanged afterwards.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from types import ModuleType

import pytest

from .conftest import COMMAND, LAUNCHER, alive, child_env, descendants, wait_until

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def launcher() -> ModuleType:
    spec = importlib.util.spec_from_file_location("launch_pd_under_test", LAUNCHER)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def run(
    launcher: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Iterator[Callable[..., tuple[int, str, str]]]:
    """``run(*argv)`` -> (exit code, stdout, stderr) of ``launch_pd.main`` in this process."""
    monkeypatch.setenv("TSPD_LOG_LEVEL", "WARNING")  # main() would set it for the ranks
    before = descendants(os.getpid())
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]

    def call(*argv: str) -> tuple[int, str, str]:
        try:
            code = launcher.main(list(argv))
        except SystemExit as exc:  # argparse: --help, or a flag it refused
            code = int(exc.code or 0)
        out = capsys.readouterr()
        return code, out.out, out.err

    yield call
    assert descendants(os.getpid()) == before  # nothing was started (or left behind)
    # A refused start leaves the caller's signal handlers as they were (a node installs its
    # own for the start-up only).
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers


def test_help_reads_like_a_manual(run: Callable[..., tuple[int, str, str]]) -> None:
    real = subprocess.run([sys.executable, str(LAUNCHER), "--help"], capture_output=True,
                          text=True, env=child_env(), timeout=120)  # fmt: skip
    assert real.returncode == 0
    for role in ("local", "bootstrap", "prefill", "decode", "colocated", "router", "demo"):
        assert f"\n  {role} " in real.stdout
    assert "examples:" in real.stdout
    assert "python apps/launch_pd.py local" in real.stdout
    assert "ROLE --help lists its flags" in real.stdout
    code, node, _ = run("prefill", "--help")
    assert code == 0
    for flag in ("--bootstrap-port PORT", "--bootstrap HOST:PORT", "--bootstrap-admin",
                 "--tp TP", "--dp DP", "--model DIR", "--transport", "--advertise-host",
                 "--bootstrap-timeout", "--device"):  # fmt: skip
        assert flag in node
    for default in ("(default: 1024)", "(default: 2048)", "(default: 8100)", "(default: 16)"):
        assert default in " ".join(node.split())  # --num-pages, prefill tokens, port, pages
    assert (
        "--layerwise-interval N stream each prefill chunk's KV N layers at a time while "
        "its forward runs; 0 = send it after the forward (default: 1 with --device cuda, 0 on "
        "cpu)" in " ".join(node.split())
    )
    # Each node lists only the timeouts its own transfer peer reads.
    for flag in ("--waiting-timeout", "--heartbeat-interval", "--heartbeat-failures"):
        assert flag not in node
    _, decode, _ = run("decode", "--help")
    for flag in ("--heartbeat-interval", "--heartbeat-failures", "--waiting-timeout"):
        assert flag in decode
    assert "--bootstrap-timeout" not in decode
    assert "--layerwise-interval" not in decode
    _, local, _ = run("local", "--help")
    assert "--standalone-bootstrap" in local
    assert "prefill: stream each prefill chunk's KV" in " ".join(local.split())
    assert "decode: s a decode room may wait for its KV (default: 300)" in " ".join(local.split())


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (
            ["decode", "--tp", "0"],
            "launch_pd.py decode: error: argument --tp: must be an integer >= 1, got '0'",
        ),
        (
            ["prefill", "--dp", "0"],
            "launch_pd.py prefill: error: argument --dp: must be an integer >= 1, got '0'",
        ),
        (
            ["decode", "--port", "70000"],
            "launch_pd.py decode: error: argument --port: "
            "a port is an integer in 0..65535, got '70000'",
        ),
        (
            ["local", "--decode-dp", "0"],
            "launch_pd.py local: error: argument --decode-dp: must be an integer >= 1, got '0'",
        ),
        (
            ["prefill", "--port", "0", "--heartbeat-interval", "3"],
            "launch_pd.py prefill: error: unrecognized arguments: --heartbeat-interval 3 "
            "(--heartbeat-interval is a decode node's flag)",
        ),
        (
            ["decode", "--bootstrap-timeout", "30"],
            "launch_pd.py decode: error: unrecognized arguments: --bootstrap-timeout 30 "
            "(--bootstrap-timeout is a prefill node's flag)",
        ),
        (
            ["prefill", "--port", "0", "--bootstrap", "127.0.0.1:9", "--bootstrap-port", "0"],
            "launch_pd.py prefill: error: give --bootstrap (an external server) or "
            "--bootstrap-port (the node's own), not both",
        ),
        (
            ["prefill", "--port", "0", "--bootstrap", "127.0.0.1:9", "--bootstrap-admin"],
            "launch_pd.py prefill: error: --bootstrap-admin applies to the bootstrap server "
            "this node hosts, not to an external one (--bootstrap)",
        ),
        (
            ["decode", "--bootstrap-admin"],
            "launch_pd.py decode: error: unrecognized arguments: --bootstrap-admin "
            "(--bootstrap-admin is a prefill node's flag)",
        ),
        (
            ["decode", "--port", "0", "--layerwise-interval", "1"],
            "launch_pd.py decode: error: unrecognized arguments: --layerwise-interval 1 "
            "(--layerwise-interval is a prefill node's flag)",
        ),
        (
            ["prefill", "--layerwise-interval", "-1"],
            "launch_pd.py prefill: error: argument --layerwise-interval: must be an integer "
            ">= 0, got '-1'",
        ),
        (
            ["decode", "--port", "0", "--heartbeat-interval", "0.5"],
            "launch_pd.py decode: error: --heartbeat-interval must be >= 2 s and "
            "--heartbeat-failures >= 1 (wire.md §8)",
        ),
        (
            ["decode", "--port", "0", "--waiting-timeout", "0"],
            "launch_pd.py decode: error: --waiting-timeout must be > 0 s",
        ),
        (
            ["decode", "--port", "0", "--tp", "3"],
            "launch_pd.py decode: error: TP 3 cannot split the model: num_attention_heads 4 is "
            "not divisible by TP size 3; valid TP sizes: 1, 2, 4",
        ),
        (
            ["local", "--prefill-tp", "3"],  # both nodes are checked before either starts
            "launch_pd.py local: error: TP 3 cannot split the model: num_attention_heads 4 is "
            "not divisible by TP size 3; valid TP sizes: 1, 2, 4",
        ),
        (
            ["prefill", "--port", "0", "--model", "smollm2-135m", "--tp", "2"],
            "launch_pd.py prefill: error: TP 2 cannot split the model: num_attention_heads 9 is "
            "not divisible by TP size 2; valid TP sizes: 1, 3",
        ),
        (
            ["local", "--model", "smollm2-135m", "--decode-tp", "9"],
            "launch_pd.py local: error: TP 9 cannot split the model: intermediate_size 1536 is "
            "not divisible by TP size 9; valid TP sizes: 1, 3",
        ),
        (
            ["decode", "--port", "0", "--model", "/nonexistent/llama"],
            "launch_pd.py decode: error: argument --model/--checkpoint: no such directory or file: "
            "/nonexistent/llama (or a model name: tiny, smollm2-135m)",
        ),
        (
            ["decode", "--port", "0", "--model", "/etc/hostname"],
            "launch_pd.py decode: error: argument --model/--checkpoint: /etc/hostname is neither a "
            "checkpoint directory nor a .gguf file",
        ),
        (
            ["router", "--port", "0", "--colocated", "http://x:1", "--tokenizer", "/nonexistent"],
            "launch_pd.py router: error: argument --tokenizer: no such directory or file: "
            "/nonexistent (or a model name: tiny, smollm2-135m)",
        ),
        (
            ["colocated", "--port", "0", "--device", "cuda"],
            "launch_pd.py colocated: error: device 'cuda' is not available: this torch build "
            "has no CUDA (use --device cpu)",
        ),
        (
            ["decode", "--port", "0", "--allow-bootstrap", "10.0.0.2"],
            "launch_pd.py decode: error: argument --allow-bootstrap: a bootstrap allowlist entry "
            "is HOST:PORT, HOST:* or *, got '10.0.0.2'",
        ),
        (
            ["router", "--port", "0"],
            "launch_pd.py router: error: give nodes: --prefill and --decode (PD) or --colocated",
        ),
        (
            ["prefill", "--port", "0", "--cluster-token", "short"],
            "launch_pd.py prefill: error: the cluster token is 5 bytes; it must be 16..4096 "
            "(e.g. 'openssl rand -hex 32')",
        ),
        (
            ["decode", "--port", "0", "--cluster-token-file", "/nonexistent/token"],
            "launch_pd.py decode: error: cannot read the cluster token file "
            "'/nonexistent/token': No such file or directory",
        ),
        (
            ["router", "--port", "0", "--prefill", "10.0.0.2:8100", "--decode", "http://x:1"],
            "launch_pd.py router: error: node URL '10.0.0.2:8100' must look like http://host:port",
        ),
    ],
)
def test_bad_flags_are_refused_in_one_line_before_anything_starts(
    run: Callable[..., tuple[int, str, str]], argv: list[str], why: str
) -> None:
    if "cuda" in argv:
        torch = pytest.importorskip("torch")
        if torch.version.cuda is not None:
            pytest.skip("this torch build has CUDA")
    code, out, err = run(*argv)
    assert code == 2
    assert err.strip().splitlines()[-1] == why
    assert "Traceback" not in err
    assert " ready on " not in out


@pytest.mark.parametrize("role", ["prefill", "decode", "router", "bootstrap"])
def test_a_taken_port_is_refused_with_the_address(
    run: Callable[..., tuple[int, str, str]], role: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        nodes = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]
        code, out, err = run(role, "--port", str(port), *(nodes if role == "router" else []))
    assert code == 2
    if role == "bootstrap":
        want = f"address already in use: 127.0.0.1:{port} (choose another --port)"
        assert err.strip() == f"launch_pd.py bootstrap: error: cannot serve: {want}"
    else:
        assert err.strip().splitlines()[-1] == (
            f"launch_pd.py {role}: error: cannot listen on 127.0.0.1:{port}: address already "
            "in use (choose another --port)"
        )
    assert " ready on " not in out


def test_a_prefill_node_whose_bootstrap_port_is_taken_refuses_to_start(
    run: Callable[..., tuple[int, str, str]],
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = run("prefill", "--port", "0", "--tp", "1", "--num-pages", "64",
                             "--bootstrap-port", str(port))  # fmt: skip
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        f"launch_pd.py prefill: error: cannot host the bootstrap server: address already in "
        f"use: 127.0.0.1:{port} (choose another --bootstrap-port, or --bootstrap HOST:PORT to "
        "use an external one)"
    )
    assert " ready on " not in out


@pytest.mark.slow
def test_local_stops_what_it_started_when_a_role_fails_to_start() -> None:
    # The prefill node refuses its taken port while the decode node is starting beside it:
    # local stops the decode node, names the role that failed, and leaves nothing behind.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, str(LAUNCHER), "local", "--log-level", "warning",
                "--prefill-port", str(port), "--decode-port", "0", "--router-port", "0",
                "--bootstrap-port", "0", "--prefill-tp", "1", "--num-pages", "64"]  # fmt: skip
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=child_env())  # fmt: skip
        tree: set[int] = set()
        while proc.poll() is None:  # every process it starts, while they run
            tree |= descendants(proc.pid)
            time.sleep(0.05)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    lines = out.splitlines()
    assert "error: prefill exited with code 2 before it was ready" in lines
    assert lines[-1] == "cluster stopped (prefill exited with code 2)"
    assert (
        f"launch_pd.py prefill: error: cannot listen on 127.0.0.1:{port}: address already in "
        "use (choose another --port)"
    ) in err.splitlines()
    assert " ready on " not in out
    assert tree  # the roles did start
    wait_until(lambda: not alive(tree), 30, "every process local started to exit")


STOP_WHILE_STARTING = """
import os, signal
import tspd_launch.cli as launch_pd

def start(opts):
    os.kill(os.getpid(), signal.SIGTERM)  # the stop comes while the engine's modules load
    raise AssertionError("the stop did not interrupt the start")

launch_pd._start_node = start
print("node returned", launch_pd._node(None), flush=True)
"""


def test_a_node_stopped_while_it_starts_exits_cleanly() -> None:
    # local stops a node whose sibling failed to start; the stop can come before the node's
    # engine modules have loaded. It must end with code 0, not die of SIGTERM ("was killed").
    out = subprocess.run([sys.executable, "-c", STOP_WHILE_STARTING], capture_output=True,
                         text=True, env=child_env(), timeout=120)  # fmt: skip
    assert (out.returncode, out.stdout) == (0, "node returned 0\n"), out.stderr


PARSE_EVERY_ROLE = """
import sys
from tspd_launch import cli

parser, roles = cli._parser()
for role in roles:
    parser.parse_args([role, *(["--colocated", "http://c:1"] if role == "router" else [])])
print(sorted(m for m in ("torch", "zmq", "mooncake", "tspd_core.pd") if m in sys.modules))
"""


def test_parsing_any_role_loads_no_torch() -> None:
    # A node role loads the engine (torch, ZMQ, Mooncake) only once _node has made a stop
    # clean (the test above); the router and replay roles never load it.
    out = subprocess.run([sys.executable, "-c", PARSE_EVERY_ROLE], capture_output=True,
                         text=True, env=child_env(), timeout=120)  # fmt: skip
    assert (out.returncode, out.stdout) == (0, "[]\n"), out.stderr


def test_local_gives_each_node_its_own_pd_flags(launcher: ModuleType) -> None:
    from tspd_launch.local import child_argv

    parser, _ = launcher.cli._parser(launcher.ENTRY)
    opts = parser.parse_args(["local", "--layerwise-interval", "3", "--waiting-timeout", "9.5",
                              "--bootstrap-timeout", "7.5"])  # fmt: skip
    argvs = {role: child_argv(opts, COMMAND, role, {}) for role in ("prefill", "decode")}

    def flags(role: str) -> list[str]:
        argv = argvs[role]
        return [f"{a} {b}" for a, b in itertools.pairwise(argv) if a.startswith("--")]

    assert {"--layerwise-interval 3", "--bootstrap-timeout 7.5"} <= set(flags("prefill"))
    assert "--waiting-timeout 9.5" in flags("decode")
    shared = " ".join(argvs["decode"])
    assert "--layerwise-interval" not in shared
    assert "--bootstrap-timeout" not in shared
    assert "--waiting-timeout" not in " ".join(argvs["prefill"])


@pytest.mark.parametrize("standalone", [False, True])
def test_local_hands_the_admin_route_to_its_bootstrap_server(
    launcher: ModuleType, standalone: bool
) -> None:
    from tspd_launch.local import child_argv

    parser, _ = launcher.cli._parser(launcher.ENTRY)
    argv = ["local", "--bootstrap-admin", *(["--standalone-bootstrap"] * standalone)]
    opts = parser.parse_args(argv)
    urls = {"bootstrap": "http://127.0.0.1:8998"}
    prefill = child_argv(opts, COMMAND, "prefill", urls)
    bootstrap = child_argv(opts, COMMAND, "bootstrap", urls)
    assert ("--bootstrap-admin" in prefill) == (not standalone)
    assert "--admin" in bootstrap
    assert "--bootstrap-admin" not in child_argv(opts, COMMAND, "decode", urls)


@pytest.mark.parametrize("standalone", [False, True])
def test_local_leaves_port_0_to_each_child_and_hands_on_the_ports_they_bound(
    launcher: ModuleType, standalone: bool
) -> None:
    # "Any free port" is picked by the child that binds it (and reported in its readiness
    # line), never by local ahead of it: a port picked and bound later can be taken between.
    from tspd_launch.local import child_argv, start_groups

    parser, _ = launcher.cli._parser(launcher.ENTRY)
    argv = ["local", *(f"--{r}-port=0" for r in ("router", "prefill", "decode", "bootstrap"))]
    opts = parser.parse_args(argv + (["--standalone-bootstrap"] if standalone else []))
    first = [("bootstrap",)] if standalone else []
    assert start_groups(opts) == [*first, ("prefill", "decode"), ("router",)]
    ready = {"bootstrap": "http://127.0.0.1:41001", "prefill": "http://127.0.0.1:41002",
             "decode": "http://127.0.0.1:41003"}  # fmt: skip

    def flags(role: str) -> dict[str, str]:
        got = child_argv(opts, COMMAND, role, ready)
        assert got[:3] == [sys.executable, str(LAUNCHER), role]
        return {a: b for a, b in itertools.pairwise(got) if a.startswith("--")}

    roles = [role for group in start_groups(opts) for role in group]
    assert [flags(role)["--port"] for role in roles] == ["0"] * len(roles)
    router = flags("router")
    assert (router["--prefill"], router["--decode"]) == (ready["prefill"], ready["decode"])
    prefill = flags("prefill")
    if standalone:
        assert prefill["--bootstrap"] == "127.0.0.1:41001"
        assert "--bootstrap-port" not in prefill
    else:
        assert prefill["--bootstrap-port"] == "0"
        assert "--bootstrap" not in prefill


@pytest.mark.parametrize(
    ("argv", "interval"),
    [([], 0), (["--device", "cuda"], 1), (["--device", "cuda:1", "--layerwise-interval", "0"], 0),
     (["--layerwise-interval", "4"], 4)],
)  # fmt: skip
def test_the_layerwise_default_follows_the_device(
    launcher: ModuleType, argv: list[str], interval: int
) -> None:
    from tspd_engine.node.cliargs import layerwise_interval

    parser, _ = launcher.cli._parser(launcher.ENTRY)
    assert layerwise_interval(parser.parse_args(["prefill", *argv])) == interval


def test_local_with_a_real_model_picks_its_tp_and_gives_the_router_its_tokenizer(
    launcher: ModuleType,
) -> None:
    from tspd_launch.local import child_argv
    from tspd_serving.models import SMOLLM2, packaged

    parser, _ = launcher.cli._parser(launcher.ENTRY)
    opts = parser.parse_args(["local", "--model", SMOLLM2])
    ready = {"prefill": "http://127.0.0.1:41002", "decode": "http://127.0.0.1:41003"}

    def flags(role: str) -> dict[str, str]:
        got = child_argv(opts, COMMAND, role, ready)
        return {a: b for a, b in itertools.pairwise(got) if a.startswith("--")}

    path = str(packaged(SMOLLM2))
    prefill, decode, router = flags("prefill"), flags("decode"), flags("router")
    # SmolLM2's 3 KV heads split over TP 1 or 3: local's default prefill TP 2 becomes 3.
    assert (prefill["--model"], prefill["--tp"]) == (path, "3")
    assert (decode["--model"], decode["--tp"]) == (path, "1")
    assert (router["--tokenizer"], router["--model"]) == (path, SMOLLM2)
    tiny = parser.parse_args(["local"])
    assert "--tokenizer" not in child_argv(tiny, COMMAND, "router", ready)
    assert (tiny.prefill_tp, tiny.served_model_name) == (2, "tspd-tiny")
