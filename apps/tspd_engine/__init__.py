"""tspd's reference engine: a small Llama-style decoder over a paged KV arena, tensor parallel
across rank processes, driven by tspd_core's request scheduler and device token feed.

See docs/engine.md. The front doors: :class:`Engine` (one rank, in-process),
:func:`launch` → :class:`EngineHandle` with an :class:`EngineClient` (rank processes), and
``python -m tspd_engine {generate,serve}``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tspd_engine.config import EngineConfig
    from tspd_engine.frames import FinishReason, Output, RequestMode, SamplingParams
    from tspd_engine.loop.core import EngineCore
    from tspd_engine.loop.engine import Engine
    from tspd_engine.loop.hooks import PdHooks
    from tspd_engine.model.config import ModelConfig
    from tspd_engine.model.tokenizer import ByteTokenizer
    from tspd_engine.rank.client import EngineClient, RequestStream
    from tspd_engine.rank.launch import EngineHandle, launch

# The front doors load on first use (PEP 562): a process that needs only a light module of
# the package (the router: errors, frames, tokenizers, HTTP helpers; the launcher's --help)
# does not pay for torch's import, ~2 s of CPU on a small machine.
_HOME = {
    "ByteTokenizer": "tspd_engine.model.tokenizer",
    "Engine": "tspd_engine.loop.engine",
    "EngineClient": "tspd_engine.rank.client",
    "EngineConfig": "tspd_engine.config",
    "EngineCore": "tspd_engine.loop.core",
    "EngineHandle": "tspd_engine.rank.launch",
    "FinishReason": "tspd_engine.frames",
    "ModelConfig": "tspd_engine.model.config",
    "Output": "tspd_engine.frames",
    "PdHooks": "tspd_engine.loop.hooks",
    "RequestMode": "tspd_engine.frames",
    "RequestStream": "tspd_engine.rank.client",
    "SamplingParams": "tspd_engine.frames",
    "launch": "tspd_engine.rank.launch",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'tspd_engine' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


__all__ = [
    "ByteTokenizer",
    "Engine",
    "EngineClient",
    "EngineConfig",
    "EngineCore",
    "EngineHandle",
    "FinishReason",
    "ModelConfig",
    "Output",
    "PdHooks",
    "RequestMode",
    "RequestStream",
    "SamplingParams",
    "launch",
]
