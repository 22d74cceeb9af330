"""Load TokenSpeed's Python runtime (the interop fixture) on a CPU-only machine.

The fixture lives at ``../shared/interop/tokenspeed`` from the repository root (CI keeps it at
the same relative place); a clone elsewhere names the ``python/`` folder of its own TokenSpeed
checkout, at :data:`PINNED_COMMIT`, in ``TSPD_TOKENSPEED_PYTHON``. :data:`MISSING` says why
it cannot be used when neither is there.

Exactly three modules of TokenSpeed reach CUDA-only code on import (``tokenspeed_kernel``,
triton) and get small stand-ins here, before anything else of TokenSpeed is imported:

* ``tokenspeed.runtime.utils`` (its ``__init__`` star-imports ``common.py``): a package whose
  submodules (``network``, ``dispatch``, ...) still load from TokenSpeed's own directory; it
  provides ``get_colorful_logger`` as a plain propagating logger (with its ``warning_once``),
  so the tests capture TokenSpeed's log lines, and ``flatten_nested_list`` (what the request
  classes' imports use of ``common.py``);
* ``tokenspeed.runtime.utils.env``: ``envs``, the ``TOKENSPEED_*`` knobs the PD, EPD and cache
  modules read, with TokenSpeed's defaults and its parsing (environment first);
* ``tokenspeed.runtime.layers.logits_processor``: the one class ``pd/utils.py`` names.

Everything else is TokenSpeed's code as it is, with three machine adaptations the fixture's
README asks for: the local-IP look-up answers the loopback address (no traffic leaves the
machine), Mooncake is initialised with ``tcp`` instead of ``rdma``, and the bootstrap server
binds 127.0.0.1 (see :mod:`tspd_testing.interop.host`).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import types
from pathlib import Path
from typing import Any

#: The repository root (this file is packages/tspd-testing/src/tspd_testing/interop/env.py).
REPO = Path(__file__).resolve().parents[5]
#: TokenSpeed's commit the fixture holds and these tests were written against.
PINNED_COMMIT = "f4d8ec6e039c028c7ee71317ccfb84e56ae2b45c"
#: Names TokenSpeed's ``python/`` folder of a checkout of the user's own (at
#: :data:`PINNED_COMMIT`), for a clone of tspd outside the layout that has the fixture.
ENV_VAR = "TSPD_TOKENSPEED_PYTHON"
FIXTURE = (REPO / ".." / "shared" / "interop" / "tokenspeed").resolve()


def _python_dir() -> tuple[Path, str]:
    """TokenSpeed's ``python/`` folder, and where it was named (for the skip message)."""
    given = os.environ.get(ENV_VAR)
    if given:
        return Path(given).expanduser().resolve(), f"{ENV_VAR}={given}"
    return FIXTURE / "python", f"the fixture at {FIXTURE}"


PYTHON, _WHERE = _python_dir()

MISSING: str | None = (
    None
    if (PYTHON / "tokenspeed" / "runtime" / "pd" / "cache_protocol.py").is_file()
    else f"TokenSpeed's runtime not found ({_WHERE} has no tokenspeed/runtime/pd/"
    f"cache_protocol.py): set {ENV_VAR} to the python/ folder of a TokenSpeed checkout at "
    f"commit {PINNED_COMMIT[:12]} (lightseekorg/tokenspeed)"
)

LOOPBACK = "127.0.0.1"


class _EnvField:
    """One ``TOKENSPEED_*`` knob, read from the environment like TokenSpeed's ``EnvField``."""

    def __init__(self, name: str, default: Any, parse: Any) -> None:
        self.name, self.default, self._parse = name, default, parse

    def get(self) -> Any:
        raw = os.environ.get(self.name)
        return self.default if raw is None else self._parse(raw)

    def is_set(self) -> bool:
        return self.name in os.environ

    def get_set_value_or(self, value: Any) -> Any:
        return self.get() if self.is_set() else value


def _bool(raw: str) -> bool:
    low = raw.lower()
    if low in ("true", "1", "yes", "y"):
        return True
    if low in ("false", "0", "no", "n"):
        return False
    raise ValueError(f"{raw!r} is not a boolean")


# The knobs the PD / EPD managers, the metrics collector and the cache recipes read, with
# TokenSpeed's defaults at the pinned commit (its utils/env.py).
_KNOBS: dict[str, tuple[Any, Any]] = {
    "TOKENSPEED_CI_SMALL_KV_SIZE": (-1, int),
    "TOKENSPEED_TEST_REQUEST_TIME_STATS": (False, _bool),
    "TOKENSPEED_HOST_IP": ("", str),
    "TOKENSPEED_DISAGGREGATION_FAILED_SESSION_TTL": (30, int),
    "TOKENSPEED_DISAGGREGATION_HEARTBEAT_INTERVAL": (5.0, float),
    "TOKENSPEED_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": (2, int),
    "TOKENSPEED_DISAGGREGATION_QUEUE_SIZE": (4, int),
    "TOKENSPEED_DISAGGREGATION_THREAD_POOL_SIZE": (-1, int),
    "TOKENSPEED_DISAGGREGATION_BOOTSTRAP_TIMEOUT": (120, int),
    "TOKENSPEED_DISAGGREGATION_WAITING_TIMEOUT": (300, int),
    "TOKENSPEED_EPD_ENCODE_RING_SLOTS": (64, int),
    "TOKENSPEED_EPD_ENCODE_RING_SLOT_MB": (None, int),
    "TOKENSPEED_EPD_RECV_POOL_SLOTS": (16, int),
    "TOKENSPEED_EPD_RECV_POOL_SLOT_MB": (256, int),
    "TOKENSPEED_EPD_EMBEDDING_SHARD": (True, _bool),
    "TOKENSPEED_PD_LAYERWISE_DEBUG": (False, _bool),
    "TOKENSPEED_PD_PREFILL_METADATA_TIMEOUT": (5.0, float),
    "TOKENSPEED_MAMBA_SSM_DTYPE": ("float32", str),
    # read at import by the request classes (engine/io_struct.py and what it loads)
    "TOKENSPEED_LOG_MM_TIMING": (False, _bool),
    "TOKENSPEED_USE_PICKLE_IPC": (False, _bool),
}


def _flatten(nested: Any) -> list[Any]:
    """``common.py``'s ``flatten_nested_list``: the leaves of nested lists, in order."""
    if not isinstance(nested, list):
        return [nested]
    return [leaf for item in nested for leaf in _flatten(item)]


def _logger(name: str | None = None) -> logging.Logger:
    """A plain propagating logger with the one extra method TokenSpeed's PD code calls on its
    colorful one: ``warning_once`` (a message logged once per process)."""
    log = logging.getLogger(name)
    if not hasattr(log, "warning_once"):
        said: set[str] = set()

        def warning_once(msg: str, *args: Any) -> None:
            if msg not in said:
                said.add(msg)
                log.warning(msg, *args)

        log.warning_once = warning_once  # type: ignore[attr-defined]
    return log


def _stand_ins() -> dict[str, types.ModuleType]:
    utils = types.ModuleType("tokenspeed.runtime.utils")
    utils.__path__ = [str(PYTHON / "tokenspeed" / "runtime" / "utils")]
    utils.get_colorful_logger = _logger  # type: ignore[attr-defined]
    utils.flatten_nested_list = _flatten  # type: ignore[attr-defined]  # multimodal/hash.py

    env = types.ModuleType("tokenspeed.runtime.utils.env")
    env.envs = types.SimpleNamespace(  # type: ignore[attr-defined]
        **{name: _EnvField(name, d, p) for name, (d, p) in _KNOBS.items()}
    )
    env.global_server_args_dict = {}  # type: ignore[attr-defined]

    logits = types.ModuleType("tokenspeed.runtime.layers.logits_processor")

    class LogitsProcessorOutput:  # named by pd/utils.py, used only by the engine's executors
        pass

    logits.LogitsProcessorOutput = LogitsProcessorOutput  # type: ignore[attr-defined]
    return {m.__name__: m for m in (utils, env, logits)}


_loaded = False


def load() -> None:
    """Make ``import tokenspeed.runtime...`` work here (idempotent). Call before importing it."""
    global _loaded
    if _loaded:
        return
    if MISSING is not None:
        raise RuntimeError(MISSING)
    sys.path.insert(0, str(PYTHON))
    # The namespace packages first, so the stand-ins hang off real parents.
    importlib.import_module("tokenspeed.runtime")
    importlib.import_module("tokenspeed.runtime.layers")
    for name, module in _stand_ins().items():
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, module)
    network: Any = importlib.import_module("tokenspeed.runtime.utils.network")
    network.get_local_ip_by_remote = lambda: LOOPBACK
    network.get_ip = lambda: LOOPBACK
    _loaded = True
