"""The engine's and the PD peer's command-line flags, shared by ``python -m tspd_engine`` and
the launcher (``tspd-launch``, ``apps/launch_pd.py``); the flags every serving program shares
(ports, counts, ``--model``'s type, HTTP limits) are :mod:`tspd_serving.cliargs`.

Values argparse can check alone (ports, counts) are refused while parsing, with the flag's
name; what needs the model (heads divisible by TP, the context limit) is refused by
:func:`engine_config` and :func:`tspd_engine.rank.launch.check_config` before any process starts.
Importing this module loads no torch (nor ZMQ, Mooncake): a launcher role that only parses
its flags (the router, ``--help``) stays light.
"""

from __future__ import annotations

import argparse
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from tspd_bootstrap.auth import TOKEN_ENV, TOKEN_FILE_ENV, ClusterCredential
from tspd_bootstrap.cli import add_credential_args as add_bootstrap_credential_args
from tspd_engine.config import EngineConfig
from tspd_engine.model.config import ModelConfig
from tspd_engine.node.allow import parse_entry
from tspd_serving.cliargs import MODEL_HELP, count, model_path, steps


def bootstrap_entry(text: str) -> str:
    """argparse type: an ``--allow-bootstrap`` entry (``HOST:PORT``, ``HOST:*``, ``*``)."""
    try:
        parse_entry(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _opt(text: str, **kwargs: Any) -> dict[str, Any]:
    return {"help": text, **kwargs}


_D = EngineConfig()
_DEFAULT = " (default: %(default)s)"
#: The engine flags: (flag, argparse keywords).
ENGINE_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--seed", _opt("seed of the random weights: same seed, same model" + _DEFAULT,
                    type=int, default=_D.seed, metavar="SEED")),
    ("--tp", _opt("tensor-parallel ranks (processes) of each replica" + _DEFAULT,
                  type=count, default=_D.tp, metavar="TP")),
    ("--page-size", _opt("tokens per KV page; P and D must match" + _DEFAULT,
                         type=count, default=_D.page_size, metavar="TOKENS")),
    ("--num-pages", _opt("KV pages per rank" + _DEFAULT,
                         type=count, default=_D.num_pages, metavar="PAGES")),
    ("--max-running", _opt("requests admitted at once" + _DEFAULT,
                           type=count, default=_D.max_running, metavar="N")),
    ("--max-prefill-tokens", _opt("prompt tokens one round may prefill; longer prompts are "
                                  "chunked" + _DEFAULT, type=count,
                                  default=_D.max_prefill_tokens, metavar="TOKENS")),
    ("--max-model-len", _opt("longest prompt + output (default: the model's positions)",
                             type=count, metavar="TOKENS")),
    ("--no-device-feed", _opt("synchronous decode loop instead of the device token feed",
                              action="store_true")),
    ("--no-prefix-cache", _opt("no prefix reuse across requests", action="store_true")),
    ("--page-layout", _opt("KV page order: nhd (token-major; pairs with TokenSpeed nodes) or "
                           "hnd (head-major; tspd peers only, faster re-slicing between "
                           "unequal TP); P and D must match" + _DEFAULT,
                           choices=["nhd", "hnd"], default=_D.page_layout)),
    ("--device", _opt("cpu or cuda[:N]" + _DEFAULT, default=_D.device)),
    ("--dtype", _opt("compute dtype" + _DEFAULT, choices=["float32", "bfloat16", "float16"],
                     default="float32")),
    ("--threads", _opt("torch threads per rank; 0 = torch's default" + _DEFAULT,
                       type=int, default=_D.threads, metavar="N")),
    ("--no-batch-sched", _opt("CPU ranks keep Linux's normal scheduling policy instead of "
                              "SCHED_BATCH (which lets a waking transfer thread preempt a "
                              "forward on a shared core)", action="store_true")),
]  # fmt: skip


def add_engine_args(parser: argparse.ArgumentParser, tp: bool = True) -> None:
    """Model and engine flags (``tp=False`` leaves ``--tp`` to the caller)."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        "--checkpoint",
        dest="checkpoint",
        type=model_path,
        metavar="DIR|FILE.gguf|NAME",
        help=MODEL_HELP,
    )
    for flag, kwargs in ENGINE_FLAGS:
        if flag != "--tp" or tp:
            g.add_argument(flag, **kwargs)


STEP_LOG_HELP = (
    "append one CSV line per scheduler round that ran a forward (what it computed and how "
    "long it took; rank 0 writes it) to FILE; with --dp > 1 replica N writes STEM.rN.SUFFIX "
    "beside it. 'tspd-sim calibrate' fits its step-time model on these lines "
    "(docs/engine.md, 'Step log')"
)


def add_step_log_arg(parser: argparse.ArgumentParser) -> None:
    """``--step-log FILE`` (a serving node's; ``tspd-launch local`` has ``--step-logs DIR``)."""
    parser.add_argument("--step-log", type=Path, metavar="FILE", help=STEP_LOG_HELP)


def engine_config(opts: argparse.Namespace, tp: int | None = None) -> EngineConfig:
    """The config the flags describe (``tp`` overrides ``--tp``); ConfigError if invalid."""
    return EngineConfig(
        model=ModelConfig(dtype=opts.dtype),
        checkpoint=opts.checkpoint,
        seed=opts.seed,
        tp=tp if tp is not None else opts.tp,
        page_size=opts.page_size,
        num_pages=opts.num_pages,
        max_running=opts.max_running,
        max_prefill_tokens=opts.max_prefill_tokens,
        max_model_len=opts.max_model_len,
        prefix_cache=not opts.no_prefix_cache,
        device_feed=not opts.no_device_feed,
        page_layout=opts.page_layout,
        device=opts.device,
        threads=opts.threads,
        batch_sched=not opts.no_batch_sched,
        step_log=getattr(opts, "step_log", None),
    )


#: The PD flags that override a tunable (wire.md §8): flag dest -> (PdTunables field, the node
#: role whose peer reads it, help). A prefill peer times out rooms whose D never shows up; a
#: decode peer times out rooms whose KV never arrives and heartbeats the prefill nodes.
TUNABLE_FLAGS = {
    "bootstrap_timeout": (
        "bootstrap_timeout_s",
        "prefill",
        "s a prefill room may wait for its decode side (default: 120)",
    ),
    "waiting_timeout": (
        "waiting_timeout_s",
        "decode",
        "s a decode room may wait for its KV (default: 300)",
    ),
    "heartbeat_interval": (
        "heartbeat_interval_s",
        "decode",
        "s between GET /health probes of each prefill node's bootstrap "
        "server (default: 5, at least 2)",
    ),
    "heartbeat_failures": (
        "heartbeat_max_failure",
        "decode",
        "failed probes in a row that declare a prefill node dead and fail its rooms (default: 2)",
    ),
}


#: Layers per interval a prefill node streams when the forward runs on a GPU (wire.md §7's and
#: TokenSpeed's default). On CPU the default is 0: there the forward and the transfer worker's
#: sends share the cores, and streaming measured no gain and worse TTFT tails
#: (docs/measurements/e2e.md).
LAYERWISE_INTERVAL = 1
LAYERWISE_HELP = (
    "stream each prefill chunk's KV N layers at a time while its forward runs; 0 = send it "
    f"after the forward (default: {LAYERWISE_INTERVAL} with --device cuda, 0 on cpu)"
)
PREFILL_AFTER_HELP = (
    "hold each request until D's pages are ready (its room Bootstrapped) before admitting and "
    "prefilling it: no pages or compute for a request whose decode side never shows up, at "
    "the price of the bootstrap round trip in TTFT (default: prefill at once, the KV goes out "
    "the moment D pre-allocates, layerwise streaming included)"
)
#: Flags of one node role only (beyond the timeouts): flag -> the role that takes it.
ROLE_FLAGS = {
    "--layerwise-interval": "prefill",
    "--bootstrap-admin": "prefill",
    "--prefill-after-bootstrap": "prefill",
}


def add_pd_args(parser: argparse.ArgumentParser, role: str) -> None:
    """The PD transfer flags of a ``prefill`` or ``decode`` node (each gets only the
    timeouts its own peer reads), or of ``local`` (both nodes' timeouts)."""
    g = parser.add_argument_group("PD transfer (wire.md §8; the environment's TSPD_* knobs apply)")
    g.add_argument(
        "--transport",
        choices=["tcp", "rdma"],
        default="tcp",
        help="Mooncake transport of the KV (default: %(default)s)",
    )
    g.add_argument(
        "--ib-device",
        default="",
        metavar="DEV[,DEV]",
        help="RDMA device(s) for Mooncake (default: auto)",
    )
    g.add_argument(
        "--advertise-host",
        metavar="HOST",
        help="address this node's ranks bind their ZMQ control sockets to and other "
        "nodes reach them at, also the name of their Mooncake sessions (default: "
        "$TSPD_HOST, else --host when it is one address, else the source address of the "
        "default route)",
    )
    if role in ("prefill", "local"):
        g.add_argument(
            "--layerwise-interval",
            type=steps,
            metavar="N",
            help=LAYERWISE_HELP if role != "local" else f"prefill: {LAYERWISE_HELP}",
        )
        g.add_argument(
            "--prefill-after-bootstrap",
            action="store_true",
            help=PREFILL_AFTER_HELP if role != "local" else f"prefill: {PREFILL_AFTER_HELP}",
        )
    for flag, (_, reader, text) in TUNABLE_FLAGS.items():
        if role in (reader, "local"):
            kind = int if flag == "heartbeat_failures" else float
            g.add_argument(
                f"--{flag.replace('_', '-')}",
                type=kind,
                metavar="S" if kind is float else "N",
                help=text if role != "local" else f"{reader}: {text}",
            )


def layerwise_interval(opts: argparse.Namespace) -> int:
    """The prefill node's layerwise interval: the flag, else by device (see
    :data:`LAYERWISE_INTERVAL`)."""
    given: int | None = getattr(opts, "layerwise_interval", None)
    if given is not None:
        return given
    return LAYERWISE_INTERVAL if str(opts.device).startswith("cuda") else 0


def tunable_overrides(opts: argparse.Namespace) -> dict[str, float]:
    """The PD tunables the flags override (wire.md §8), checked: PdTunables field -> value,
    empty when no flag is given (each rank then reads its environment;
    :func:`tspd_engine.node.run.pd_tunables` applies them)."""
    given: dict[str, float] = {
        field: getattr(opts, flag)
        for flag, (field, _, _) in TUNABLE_FLAGS.items()
        if getattr(opts, flag, None) is not None
    }
    if given.get("heartbeat_interval_s", 2.0) < 2.0 or given.get("heartbeat_max_failure", 1) < 1:
        raise ValueError(
            "--heartbeat-interval must be >= 2 s and --heartbeat-failures >= 1 (wire.md §8)"
        )
    for flag in ("bootstrap_timeout_s", "waiting_timeout_s"):
        if given.get(flag, 1.0) <= 0:
            raise ValueError(f"--{flag[:-2].replace('_', '-')} must be > 0 s")
    return given


# -- admission control (a serving node's bound on the requests it holds) --------------------

CAPACITY_HELP = (
    "requests this node holds at most, running and queued over its replicas; one more is "
    'refused with 503, Retry-After and "busy": true before it reaches an engine (the router '
    "tries another node or answers 429); 0 = 2 x --max-running x --dp (default: 0)"
)


def add_capacity_arg(parser: argparse.ArgumentParser, local: bool = False) -> None:
    """``--max-queued-requests N`` (a node's; ``local`` gives it to both of its nodes)."""
    text = f"each node: {CAPACITY_HELP}" if local else CAPACITY_HELP
    parser.add_argument("--max-queued-requests", type=steps, default=0, metavar="N", help=text)


# -- the cluster credential (docs/bootstrap.md, "The cluster credential") --------------------

#: The launcher's roles that take ``--cluster-token`` / ``--cluster-token-file``: every role
#: that registers, looks up or serves registrations (the router and a colocated node never do).
CREDENTIAL_ROLES = ("local", "bootstrap", "prefill", "decode")


def add_credential_args(parser: argparse.ArgumentParser) -> None:
    """``--cluster-token-file PATH`` / ``--cluster-token TOKEN`` (the standalone
    ``tspd-bootstrap``'s flags, with the same environment fallback)."""
    add_bootstrap_credential_args(parser)


def export_credential(opts: argparse.Namespace, env: MutableMapping[str, str]) -> str:
    """Put the credential the flags give into ``env`` (the environment this role's processes
    inherit: a node's ranks and transfer workers, ``local``'s roles), so it never shows on a
    command line of ours; check whichever credential ``env`` then holds. Returns its
    fingerprint ("" when the credential is off); ValueError when it is unusable."""
    token: str | None = getattr(opts, "cluster_token", None)
    path: str | None = getattr(opts, "cluster_token_file", None)
    credential = ClusterCredential.resolve(token, path, env)  # refused before env changes
    if token is not None:
        env.pop(TOKEN_FILE_ENV, None)
        env[TOKEN_ENV] = token
    elif path is not None:
        env.pop(TOKEN_ENV, None)
        env[TOKEN_FILE_ENV] = str(Path(path).resolve())
    return "" if credential is None else credential.fingerprint
