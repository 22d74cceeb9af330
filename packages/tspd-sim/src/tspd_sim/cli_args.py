"""Command-line options shared by the subcommands, and their translation into a run.

Kept apart from :mod:`tspd_sim.cli` so the option groups can be reused: ``compare`` parses each
``--variant`` with the same cluster options, on top of the base command line.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from tspd_core.layout import PageLayout, PlaneArrangement
from tspd_sim.cluster import PREEMPTION, ClusterSpec, EngineTuning, GroupSpec, parse_group
from tspd_sim.cost.calibration import load_calibration
from tspd_sim.errors import SpecError, TraceError
from tspd_sim.metrics import Slo
from tspd_sim.network import NET_PROFILES
from tspd_sim.sim.context import SimConfig
from tspd_sim.sim.router import POLICIES, RoutingSpec
from tspd_sim.spec_files import load_gpu_file, resolve_model
from tspd_sim.specs import GPUS, MODELS, GpuSpec
from tspd_sim.traces import BUNDLED, Trace, load_trace, synthetic

_TUNING = EngineTuning()


class _Renamed(argparse.Action):
    """An old spelling of a flag, kept out of ``--help``: it sets what the new flag sets
    (its value, or ``const`` for a switch) and prints a one-line deprecation note."""

    def __init__(self, option_strings: list[str], dest: str, note: str, **kwargs: Any) -> None:
        self.note = note
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(f"{parser.prog}: {option_string} is deprecated; {self.note}", file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def _renamed(g: Any, old: str, new: str, note: str = "", **kwargs: Any) -> None:
    """Register ``old`` as a hidden, deprecated spelling of ``new`` (same destination); its
    note says ``note``, else to use ``new``."""
    dest = new.removeprefix("--no-").removeprefix("--").replace("-", "_")
    if "const" in kwargs:
        kwargs["nargs"] = 0
    g.add_argument(
        old,
        dest=dest,
        action=_Renamed,
        note=note or f"use {new}",
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
        **kwargs,
    )


def add_trace_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trace (what is replayed)")
    g.add_argument(
        "--trace",
        default="mooncake",
        metavar="NAME|FILE|synthetic",
        help=f"bundled trace {sorted(BUNDLED)}, a Mooncake .jsonl or Azure .csv "
        f"file, or 'synthetic' (default: mooncake, 12,031 requests over 1 h)",
    )
    g.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="replay X times faster (X > 1 raises the arrival rate; default 1)",
    )
    g.add_argument("--max-requests", type=int, metavar="N", help="only the first N requests")
    g.add_argument(
        "--duration",
        type=float,
        metavar="S",
        help="only requests arriving in the first S seconds (after --rate-scale)",
    )
    g.add_argument(
        "--rate",
        type=float,
        default=4.0,
        metavar="RPS",
        help="synthetic: mean arrival rate (default 4 req/s)",
    )
    g.add_argument(
        "--requests",
        type=int,
        default=2000,
        metavar="N",
        help="synthetic: number of requests (default 2000)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        metavar="CV",
        help="synthetic: coefficient of variation of the gaps (1 = Poisson, >1 "
        "burstier Gamma; default 1)",
    )
    g.add_argument(
        "--input-len",
        default="lognormal:2048:0.8",
        metavar="DIST",
        help="synthetic prompt lengths: fixed:N, uniform:LO:HI, lognormal:MEAN:SIGMA "
        "or trace:NAME (default lognormal:2048:0.8)",
    )
    g.add_argument(
        "--output-len",
        default="lognormal:256:0.8",
        metavar="DIST",
        help="synthetic output lengths, same forms (default lognormal:256:0.8)",
    )


def add_cluster_options(p: argparse.ArgumentParser, defaults: bool = True) -> None:
    """Cluster, engine, network and routing options. ``defaults=False`` leaves every default
    unset (None) so a ``--variant`` only overrides what it names."""
    d = (lambda v: v) if defaults else (lambda v: None)
    g = p.add_argument_group("cluster (what is simulated)")
    g.add_argument(
        "--model",
        default=d("llama-3-8b"),
        metavar="NAME|PATH",
        help=f"a built-in model {sorted(MODELS)}, a Hugging Face config.json (or its folder), "
        "or a model spec .toml/.json (default llama-3-8b; formats: 'tspd-sim list')",
    )
    g.add_argument(
        "--gpu-spec",
        action="append",
        type=Path,
        metavar="FILE",
        help="a GPU spec .toml/.json, repeatable: its name can follow @ in group specs; with "
        "one file, groups without @GPU run on it (formats: 'tspd-sim list')",
    )
    g.add_argument(
        "--prefill",
        action="append",
        metavar="COUNTxTP[dpDP][@GPU]",
        help=f"a prefill instance group, repeatable (default 4xtp1@h100); GPUs: {sorted(GPUS)}",
    )
    g.add_argument(
        "--decode",
        action="append",
        metavar="COUNTxTP[dpDP][@GPU]",
        help="a decode instance group, repeatable (default 4xtp1@h100)",
    )
    g.add_argument(
        "--routing",
        default=d("prefix_aware"),
        choices=POLICIES,
        help="P/D routing policy (default prefix_aware)",
    )
    g.add_argument(
        "--page-size",
        type=int,
        default=d(_TUNING.page_size),
        metavar="TOKENS",
        help=f"tokens per KV page (default {_TUNING.page_size})",
    )
    g.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=d(_TUNING.max_prefill_tokens),
        metavar="TOKENS",
        help="prompt tokens one prefill step may compute; longer prompts are chunked "
        f"(default {_TUNING.max_prefill_tokens})",
    )
    _renamed(g, "--chunk-tokens", "--max-prefill-tokens", type=int)
    g.add_argument(
        "--max-running",
        type=int,
        metavar="N",
        help="most requests one engine holds at once, P and D alike (an engine's "
        "--max-running); the role flags below override it",
    )
    for role, default in (
        ("prefill", _TUNING.prefill_max_running),
        ("decode", _TUNING.decode_max_running),
    ):
        g.add_argument(
            f"--{role}-max-running",
            type=int,
            metavar="N",
            help=f"most requests one {role[0].upper()} engine holds at once (default {default})",
        )
        _renamed(g, f"--{role}-capacity", f"--{role}-max-running", type=int)
    g.add_argument(
        "--num-pages",
        type=int,
        default=d(_TUNING.num_pages),
        metavar="PAGES",
        help="KV pages of every engine, as an engine's --num-pages sets them (default: 0, "
        "what GPU memory holds after the weights at --mem-fraction)",
    )
    g.add_argument(
        "--mem-fraction",
        type=float,
        default=d(_TUNING.mem_fraction),
        help=f"GPU memory for weights + KV (default {_TUNING.mem_fraction})",
    )
    g.add_argument(
        "--page-layout",
        choices=[m.value for m in PageLayout],
        default=d(_TUNING.page_layout.value),
        help="KV page layout: nhd, token-major as tspd nodes by default and TokenSpeed; "
        "hnd, head-major, the closer model of two tspd nodes at unequal TP, which stage "
        f"token-major routes (default {_TUNING.page_layout.value})",
    )
    g.add_argument(
        "--arrangement",
        choices=[m.value for m in PlaneArrangement],
        default=d(_TUNING.arrangement.value),
        help=f"arena planes (default {_TUNING.arrangement.value})",
    )
    g.add_argument(
        "--no-layerwise",
        dest="layerwise",
        action="store_false",
        default=d(True),
        help="send KV after the prefill instead of per layer",
    )
    g.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        default=d(True),
        help="no prefix reuse on P or D (an engine's --no-prefix-cache)",
    )
    for role, what in (
        ("prefill", "P computes every prompt in full"),
        ("decode", "every prompt page is transferred"),
    ):
        g.add_argument(
            f"--no-{role}-prefix-cache",
            dest=f"{role}_prefix_cache",
            action="store_false",
            default=d(True),
            help=f"{role[0].upper()} keeps no prefix cache ({what})",
        )
    g.add_argument(
        "--no-reserve-output",
        dest="reserve_output",
        action="store_false",
        default=d(True),
        help="D admits without reserving pages for the output (it then preempts when "
        "decode runs out of pages, see --preemption)",
    )
    g.add_argument(
        "--decode-rounds",
        action=argparse.BooleanOptionalAction,
        default=d(_TUNING.decode_rounds),
        help="D works in rounds, as tspd's engine: a request reaching a stepping D is "
        "admitted at its next step boundary, and a first token leaving D leaves with the "
        "request's first decode step (default: on; --no-decode-rounds: both at once, the "
        "first token with the KV)",
    )
    g.add_argument(
        "--hold-first-token",
        action=argparse.BooleanOptionalAction,
        default=d(not _TUNING.early_first_token),
        help="the first token leaves D, as behind a router started with --hold-first-token "
        "(default: off; it leaves P as the prefill ends, as tspd's router passes P's token on)",
    )
    _renamed(
        g,
        "--first-token-from-prefill",
        "--no-hold-first-token",
        "it is the default now (--hold-first-token turns it off)",
        const=False,
    )
    g.add_argument(
        "--preemption",
        choices=PREEMPTION,
        default=d(_TUNING.preemption),
        help="what D does out of pages: recompute (drop the newest request's KV, re-prefill "
        "it on D) or swap (its KV to host memory and back) (default recompute)",
    )
    g.add_argument(
        "--net",
        choices=sorted(NET_PROFILES),
        default=d("rdma"),
        help="network profile: rdma (400 Gb/s NIC per GPU) or tcp-dev (this dev "
        "machine's Mooncake over TCP) (default rdma)",
    )
    g.add_argument(
        "--nic-gbps",
        type=float,
        default=None,
        metavar="GB/S",
        help="override the NIC rate per GPU, in GB/s",
    )
    g.add_argument(
        "--calibration",
        default=d(None),
        metavar="FILE|splitwise",
        help="calibration file (JSON/TOML) overriding the roofline, or 'splitwise'",
    )
    g.add_argument("--seed", type=int, default=d(0), help="seed for rooms and synthetic traces")


def add_slo_options(p: argparse.ArgumentParser) -> None:
    slo = Slo()
    g = p.add_argument_group("service-level objective")
    g.add_argument(
        "--slo-ttft",
        type=float,
        default=slo.ttft_s,
        metavar="S",
        help=f"TTFT target in seconds (default {slo.ttft_s})",
    )
    g.add_argument(
        "--slo-tpot",
        type=float,
        default=slo.tpot_s,
        metavar="S",
        help=f"TPOT target in seconds (default {slo.tpot_s})",
    )
    g.add_argument(
        "--target",
        type=float,
        default=0.9,
        metavar="FRAC",
        help="SLO attainment a configuration must reach (search; default 0.9)",
    )


def add_output_options(p: argparse.ArgumentParser, default_dir: str) -> None:
    g = p.add_argument_group("output")
    g.add_argument(
        "--out",
        type=Path,
        default=Path(default_dir),
        metavar="DIR",
        help=f"results folder (default {default_dir})",
    )
    g.add_argument(
        "--format",
        choices=("parquet", "csv"),
        default="parquet",
        help="per-request table format (default parquet)",
    )
    g.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


# ---- namespace → objects -----------------------------------------------------------------------


def build_trace(ns: argparse.Namespace) -> Trace:
    """The trace the options describe (loaded, cut and rescaled)."""
    if ns.trace == "synthetic":
        trace = synthetic(
            ns.requests, ns.rate, ns.input_len, ns.output_len, cv=ns.burstiness, seed=ns.seed
        )
    else:
        trace = load_trace(ns.trace)
    if ns.max_requests is not None:
        trace = trace.head(ns.max_requests)
    if ns.rate_scale != 1.0:
        trace = trace.scale_rate(ns.rate_scale)
    if ns.duration is not None:
        trace = trace.window(0.0, ns.duration)
    if not len(trace):
        raise TraceError("the trace options leave no request to replay")
    return trace


def gpu_files(ns: argparse.Namespace) -> dict[str, GpuSpec]:
    """The GPUs of the ``--gpu-spec`` files, by name (a name given twice is an error)."""
    gpus: dict[str, GpuSpec] = {}
    for path in ns.gpu_spec or []:
        gpu = load_gpu_file(path)
        if gpu.name in gpus:
            raise SpecError(f"--gpu-spec: two files describe GPU {gpu.name!r}")
        gpus[gpu.name] = gpu
    return gpus


def parse_groups(
    texts: list[str] | None, default: str, ns: argparse.Namespace
) -> tuple[GroupSpec, ...]:
    """Group specs against the ``--gpu-spec`` GPUs; groups without @GPU run on the only
    --gpu-spec GPU when exactly one is given, else on H100."""
    gpus = gpu_files(ns)
    fallback: str | GpuSpec = next(iter(gpus.values())) if len(gpus) == 1 else "h100"
    return tuple(parse_group(t, gpus, fallback) for t in (texts or [default]))


def build_config(ns: argparse.Namespace) -> SimConfig:
    """The simulation config the cluster options describe."""
    tuning = EngineTuning(
        page_size=ns.page_size,
        max_prefill_tokens=ns.max_prefill_tokens,
        prefill_max_running=_running(ns, "prefill", _TUNING.prefill_max_running),
        decode_max_running=_running(ns, "decode", _TUNING.decode_max_running),
        mem_fraction=ns.mem_fraction,
        layerwise=ns.layerwise,
        prefill_prefix_cache=ns.prefix_cache and ns.prefill_prefix_cache,
        decode_prefix_cache=ns.prefix_cache and ns.decode_prefix_cache,
        page_layout=ns.page_layout,
        arrangement=ns.arrangement,
        reserve_output=ns.reserve_output,
        preemption=ns.preemption,
        num_pages=ns.num_pages,
        decode_rounds=ns.decode_rounds,
        early_first_token=not ns.hold_first_token,
    )
    cluster = ClusterSpec(
        model=resolve_model(ns.model),
        prefill=parse_groups(ns.prefill, "4xtp1", ns),
        decode=parse_groups(ns.decode, "4xtp1", ns),
        tuning=tuning,
    )
    net = NET_PROFILES[ns.net]
    if ns.nic_gbps is not None:
        if ns.nic_gbps <= 0:
            raise SpecError(f"--nic-gbps {ns.nic_gbps}: must be > 0")
        net = replace(net, nic_bw=ns.nic_gbps * 1e9)
    return SimConfig(
        cluster=cluster,
        routing=RoutingSpec(ns.routing),
        net=net,
        calibration=load_calibration(ns.calibration),
        seed=ns.seed,
    )


def _running(ns: argparse.Namespace, role: str, default: int) -> int:
    """A role's most running requests: its own flag, else --max-running, else ``default``."""
    own: int | None = getattr(ns, f"{role}_max_running")
    if own is not None:
        return own
    both: int | None = ns.max_running
    return default if both is None else both


def build_slo(ns: argparse.Namespace) -> Slo:
    return Slo(ns.slo_ttft, ns.slo_tpot)


def merge_variant(base: argparse.Namespace, over: argparse.Namespace) -> argparse.Namespace:
    """``base`` with every option ``over`` set (not None) replaced."""
    merged = argparse.Namespace(**vars(base))
    for key, value in vars(over).items():
        if value is not None:
            setattr(merged, key, value)
    return merged
