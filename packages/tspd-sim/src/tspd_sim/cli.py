"""``tspd-sim``: replay traces on simulated P/D clusters, search capacity, compare variants.

Examples::

    tspd-sim run                                   # Mooncake trace, 4 P + 4 D Llama-3-8B/H100
    tspd-sim run --prefill 2xtp2 --decode 4xtp1 --routing least_load --rate-scale 2
    tspd-sim run --trace synthetic --rate 8 --burstiness 3 --requests 5000
    tspd-sim search --duration 600                 # highest rate meeting the SLO (90 %)
    tspd-sim search --duration 600 --grid-prefill 2xtp1 4xtp1 --grid-decode 2xtp1 4xtp1
    tspd-sim compare --variant "rr: --routing round_robin" --variant "pa: --routing prefix_aware"
    tspd-sim search --grid-routing round_robin least_load --ray 10.0.0.1:6379   # on Ray
    tspd-sim list                                  # models, GPUs, traces, policies
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

from tspd_sim import cli_args as opts
from tspd_sim import plots
from tspd_sim.catalog import listing
from tspd_sim.cost.calibration import calibration_document, collect_steps, load_calibration
from tspd_sim.cost.fidelity import fidelity_table
from tspd_sim.cost.fitted import (
    TRIM_SIGMAS,
    DecodeCoeffs,
    FittedCost,
    PrefillCoeffs,
    describe_fit,
    fit_phase,
)
from tspd_sim.errors import SimError
from tspd_sim.measured import compare, figures, read_requests, trace_of
from tspd_sim.metrics import SimResult
from tspd_sim.parallel import run_points
from tspd_sim.report import print_table, summary_table, write_frame, write_run
from tspd_sim.search import Probe, capacity_search, run_grid, vary
from tspd_sim.sim import SimConfig, Simulation
from tspd_sim.sim.router import POLICIES
from tspd_sim.spec_files import resolve_model
from tspd_sim.specs import gpu_spec, model_spec
from tspd_sim.traces import BUNDLED, Trace, load_trace


def _parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="tspd-sim",
        description=__doc__.split("\n\n")[0],
        epilog="Run 'tspd-sim COMMAND --help' for the options of each command.",
    )
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="replay a trace on one cluster and report",
        description="Replay a trace on one P/D cluster: summary table, "
        "per-request table, timelines and plots.",
    )
    search = sub.add_parser(
        "search",
        help="capacity search (one config or a grid)",
        description="Find the highest arrival rate meeting the SLO for "
        "--target of the requests (bisection on the rate "
        "scale); with --grid-* options, for every combination, "
        "in parallel processes.",
    )
    comp = sub.add_parser(
        "compare",
        help="run variants side by side on the same trace",
        description="Run the base command line and each --variant (extra "
        "cluster options) on the same trace, in parallel; "
        "print one column per variant and overlay the CDFs.",
    )
    for p, out in (
        (run, "sim-results/run"),
        (search, "sim-results/search"),
        (comp, "sim-results/compare"),
    ):
        opts.add_trace_options(p)
        opts.add_cluster_options(p)
        opts.add_slo_options(p)
        opts.add_output_options(p, out)
    g = search.add_argument_group("grid (each option takes several values)")
    g.add_argument("--grid-prefill", nargs="+", metavar="SPEC", help="prefill groups to try")
    g.add_argument("--grid-decode", nargs="+", metavar="SPEC", help="decode groups to try")
    g.add_argument("--grid-routing", nargs="+", choices=POLICIES, help="policies to try")
    g.add_argument("--workers", type=int, help="parallel processes (default: CPU count)")
    g.add_argument("--iters", type=int, default=6, help="bisection steps after bracketing")
    _add_ray_arg(g, "each configuration's search (without --grid-*: the one search)")
    comp.add_argument(
        "--variant",
        action="append",
        required=True,
        metavar="'NAME: OPTIONS'",
        help="a labelled set of cluster options, e.g. 'tp2: --prefill 2xtp2'",
    )
    comp.add_argument("--workers", type=int, help="parallel processes (default: CPU count)")
    _add_ray_arg(comp, "each variant's replay")
    sub.add_parser(
        "list",
        help="built-in models, GPUs, traces and policies; the model and GPU file formats",
    )
    fid = sub.add_parser(
        "fidelity",
        help="the simulator against measurements: a real cluster's run, or SplitwiseSim's steps",
        description="With --real: replay the requests of a measured run (the per-request table "
        "'tspd-launch replay' wrote against a real cluster) on the cluster the options "
        "describe, and print TTFT and TPOT p50/p90 and throughput side by side with the "
        "relative error and the goal (p50 within 20 %, p90 within 35 %). Without it: price "
        "SplitwiseSim's measured Llama-2-70B / H100 / TP 8 steps with the cost model "
        "(--calibration) and print predicted/measured.",
    )
    fid.add_argument(
        "--real",
        type=Path,
        metavar="FILE",
        help="a measured run's per-request table (requests.parquet or .csv of the replay)",
    )
    opts.add_cluster_options(fid)
    opts.add_output_options(fid, "sim-results/fidelity")
    cal = sub.add_parser(
        "calibrate",
        help="fit step-time coefficients from a real node's step log or measured steps",
        description="Fit prefill/decode coefficients (tspd_sim.cost.fitted) and write a "
        "calibration file for --calibration: one fitted engine per TP. Inputs are step logs "
        "of real nodes (tspd-launch ... --step-log FILE: one line per round; the engine's "
        "TP is in each line; rounds that ran prefill and decode together are left out) "
        "and/or CSVs of measured steps (columns phase, batch, new_tokens, context, seconds; "
        "they need --tp). A phase no input measured (a prefill node's log has no decode "
        "steps) is left to the roofline. A step log's rounds are fitted in seconds (their "
        "mean), a CSV's medians by relative least squares.",
    )
    cal.add_argument(
        "measurements", nargs="+", type=Path, metavar="FILE", help="step logs and/or CSVs"
    )
    cal.add_argument("--model", required=True, metavar="NAME|PATH", help="model (as for run)")
    cal.add_argument(
        "--gpu", required=True, metavar="NAME", help="GPU name (built-in or --gpu-spec)"
    )
    cal.add_argument("--gpu-spec", action="append", type=Path, metavar="FILE", help="GPU spec file")
    cal.add_argument(
        "--tp",
        type=int,
        help="the TP of a measurements CSV's engine (required for one); with step logs, "
        "fit only their rounds of this TP",
    )
    cal.add_argument(
        "--no-trim",
        dest="trim",
        action="store_false",
        help="fit every round of a step log (default: refit without the rounds the first "
        f"fit misses by more than {TRIM_SIGMAS:g} robust standard deviations: rounds another "
        "process held up)",
    )
    cal.add_argument("-o", "--output", type=Path, required=True, help="calibration JSON to write")
    return top


def _add_ray_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup, what: str) -> None:
    parser.add_argument(
        "--ray",
        metavar="ADDRESS",
        help=f"run {what} as a task of the Ray cluster whose head is at ADDRESS (HOST:PORT, or "
        "auto: the cluster this machine is in) instead of in processes here (--workers is then "
        "Ray's to decide: one CPU a task); the results are the same. Needs the extra "
        "tspd-sim[ray], installed on every node",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tspd-sim`` script."""
    ns = _parser().parse_args(argv)
    try:
        commands = {
            "run": _run,
            "search": _search,
            "compare": _compare,
            "list": _list,
            "fidelity": _fidelity,
            "calibrate": _calibrate,
        }
        return commands[ns.command](ns)
    except (SimError, OSError) as exc:
        print(f"tspd-sim: error: {exc}", file=sys.stderr)
        return 2


def _run(ns: argparse.Namespace) -> int:
    trace, config, slo = opts.build_trace(ns), opts.build_config(ns), opts.build_slo(ns)
    # Parquet rows stream straight to the output folder; CSV is written from them afterwards.
    direct = ns.out if ns.format == "parquet" else None
    result = Simulation(trace, config).run(progress=not ns.quiet, out=direct)
    print_table(
        summary_table(
            {config.cluster.label(): result.summary(slo)}, f"{trace.name}: {len(trace):,} requests"
        )
    )
    files = write_run(result, slo, ns.out, ns.format)
    if ns.plots:
        files += _plots({"run": result}, result, ns)
    print(f"wrote {len(files)} files under {ns.out}/")
    return 0


def _plots(runs: dict[str, SimResult], main_run: SimResult, ns: argparse.Namespace) -> list[Path]:
    slo = opts.build_slo(ns)
    return [
        plots.plot_cdfs(runs, slo, ns.out / "ttft_tpot_cdf.png"),
        plots.plot_links(main_run, ns.out / "links.png"),
        plots.plot_pools(main_run, ns.out / "pools.png"),
    ]


def _search(ns: argparse.Namespace) -> int:
    trace, base, slo = opts.build_trace(ns), opts.build_config(ns), opts.build_slo(ns)
    grid = {
        k: v
        for k, v in (
            ("prefill", [opts.parse_groups([s], s, ns) for s in ns.grid_prefill or []]),
            ("decode", [opts.parse_groups([s], s, ns) for s in ns.grid_decode or []]),
            ("routing", ns.grid_routing or []),
        )
        if v
    }
    if not grid and ns.ray is None:
        cap = capacity_search(
            trace, base, slo, ns.target, iters=ns.iters, on_probe=None if ns.quiet else _show_probe
        )
        caps = [cap]
        table = cap.frame()
        print(
            f"capacity of {cap.label}: {cap.capacity_rps:.3f} req/s "
            f"({cap.capacity_rps_per_gpu:.4f} req/s per GPU, scale x{cap.scale:.3f})"
        )
    elif not grid:  # the one search, as a task of the Ray cluster
        [point] = vary(base)
        [cap] = run_grid([replace(point, label=base.cluster.label())], trace, slo, search=True,
                         target=ns.target, iters=ns.iters, ray_address=ns.ray,
                         progress=not ns.quiet).attrs["capacities"]  # fmt: skip
        caps = [cap]
        table = cap.frame()
        for p in cap.probes if not ns.quiet else ():
            _show_probe(p)
        print(
            f"capacity of {cap.label}: {cap.capacity_rps:.3f} req/s "
            f"({cap.capacity_rps_per_gpu:.4f} req/s per GPU, scale x{cap.scale:.3f})"
        )
    else:
        points = vary(base, **grid)
        table = run_grid(
            points,
            trace,
            slo,
            search=True,
            target=ns.target,
            iters=ns.iters,
            workers=ns.workers,
            ray_address=ns.ray,
            progress=not ns.quiet,
            on_done=None if ns.quiet else _show_row,
        )
        caps = table.attrs["capacities"]
        print(table.drop(columns=["probes"]).to_string(index=False))
    ns.out.mkdir(parents=True, exist_ok=True)
    write_frame(table, ns.out / "search.csv", "csv")
    if ns.plots and caps:
        plots.plot_slo_vs_rate(caps, ns.out / "slo_vs_rate.png")
    print(f"wrote results under {ns.out}/")
    return 0


def _show_probe(p: Probe) -> None:
    att = p.attainment * 100
    print(f"  probe x{p.scale:.3f}: {p.rate_rps:.3f} req/s -> attainment {att:.1f} %", flush=True)


def _show_row(row: dict[str, object]) -> None:
    # Above the progress bar (tqdm's own write), which stays on the last line.
    tqdm.write(f"  done: {row['config']} -> {row.get('capacity_rps', 0):.3f} req/s")


def _variant_job(job: tuple[str, SimConfig], trace: Trace) -> tuple[str, SimResult]:
    """One variant's replay (a process's or a Ray task's work)."""
    label, config = job
    return label, Simulation(trace, config).run()


def _compare(ns: argparse.Namespace) -> int:
    trace, slo = opts.build_trace(ns), opts.build_slo(ns)
    vparser = argparse.ArgumentParser(prog="--variant", add_help=False)
    opts.add_cluster_options(vparser, defaults=False)
    jobs = []
    for spec in ns.variant:
        label, sep, rest = spec.partition(":")
        if not sep or not label.strip():
            raise SimError(f"--variant {spec!r}: write 'NAME: OPTIONS'")
        over = vparser.parse_args(shlex.split(rest))
        jobs.append((label.strip(), opts.build_config(opts.merge_variant(ns, over))))
    runs = dict(
        run_points(
            _variant_job,
            jobs,
            trace,
            workers=ns.workers or len(jobs),
            ray_address=ns.ray,
            progress=not ns.quiet,
            what="variants",
        )
    )
    print_table(
        summary_table(
            {k: r.summary(slo) for k, r in runs.items()}, f"{trace.name}: {len(trace):,} requests"
        )
    )
    for label, result in runs.items():
        write_run(result, slo, ns.out / label.replace("/", "_"), ns.format)
    if ns.plots:
        plots.plot_cdfs(runs, slo, ns.out / "ttft_tpot_cdf.png")
    print(f"wrote results under {ns.out}/")
    return 0


def _list(ns: argparse.Namespace) -> int:
    del ns
    traces = []
    for name in sorted(BUNDLED):
        t = load_trace(name)
        d = t.describe()
        traces.append(
            f"trace {name}: {len(t):,} requests over {d['duration_s']:.0f} s, "
            f"mean prompt {d['input_mean']:.0f}, mean output {d['output_mean']:.0f}"
        )
    print(listing(traces))
    return 0


def _fidelity(ns: argparse.Namespace) -> int:
    if ns.real is not None:
        return _fidelity_real(ns)
    df = fidelity_table(load_calibration(ns.calibration))
    print(df.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    ratio = df["ratio"].to_numpy()
    print(
        f"ratio predicted/measured: min {ratio.min():.2f}, max {ratio.max():.2f}, "
        f"geometric mean {float(np.exp(np.log(ratio).mean())):.2f}"
    )
    return 0


def _fidelity_real(ns: argparse.Namespace) -> int:
    real = read_requests(ns.real)
    config = opts.build_config(ns)
    result = Simulation(trace_of(real, ns.real.stem), config).run(progress=not ns.quiet)
    table = compare(figures(real), figures(result.requests))
    print(f"{len(real)} requests of {ns.real} on {config.cluster.label()}:")
    shown = table.assign(goal=table["goal"].map(lambda g: "" if pd.isna(g) else f"±{g:.0%}"))
    print(shown.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    ns.out.mkdir(parents=True, exist_ok=True)
    write_frame(table, ns.out / "fidelity.csv", "csv")
    write_frame(result.requests, ns.out / f"requests.{ns.format}", ns.format)
    print(f"wrote results under {ns.out}/")
    return 0


def _calibrate(ns: argparse.Namespace) -> int:
    model = model_spec(resolve_model(ns.model))
    gpu = gpu_spec(opts.gpu_files(ns).get(ns.gpu.lower(), ns.gpu))
    rows, logged, mixed = collect_steps(ns.measurements, ns.tp)
    fits: dict[int, FittedCost] = {}
    for tp, samples in sorted(rows.items()):
        # A step log's rounds scatter: fit the mean round in seconds, trimmed (fit_phase).
        trim, relative = ns.trim and tp in logged, tp not in logged
        print(f"engine {model.name} @ {gpu.name} TP {tp}:")
        coeffs: list[PrefillCoeffs | DecodeCoeffs | None] = []
        for phase in ("prefill", "decode"):
            if sum(r.phase == phase for r in samples) < 2:
                print(f"  {phase}: fewer than 2 measured steps: priced by the roofline")
                coeffs.append(None)
                continue
            fit = fit_phase(samples, phase, trim, relative)
            coeffs.append(fit.coeffs)
            print(f"  {phase}: {describe_fit(fit)}")
        pre, dec = coeffs
        if pre is not None or dec is not None:
            assert not isinstance(pre, DecodeCoeffs)
            assert not isinstance(dec, PrefillCoeffs)
            fits[tp] = FittedCost(pre, dec)
    if mixed:
        print(f"left out {mixed} rounds that ran prefill and decode together (their time "
              "cannot be split between the phases)")  # fmt: skip
    if not fits:
        raise SimError("no engine has 2 measured steps of either phase: nothing to fit")
    sources = ", ".join(str(p) for p in ns.measurements)
    doc = calibration_document(model.name, gpu.name, fits, f"fit of {sources}")
    ns.output.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {ns.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
