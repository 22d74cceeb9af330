"""tspd's reference engine: a small Llama-style decoder over a paged KV arena, tensor parallel
across rank processes, driven by tspd_core's request scheduler and device token feed.

See docs/engine.md. The front doors: :class:`Engine` (one rank, in-process),
:func:`launch` → :class:`EngineHandle` with an :class:`EngineClient` (rank processes), and
``python -m tspd_engine {generate,serve}``.
"""

from tspd_engine.config import EngineConfig
from tspd_engine.frames import FinishReason, Output, RequestMode, SamplingParams
from tspd_engine.loop.core import EngineCore
from tspd_engine.loop.engine import Engine
from tspd_engine.loop.hooks import PdHooks
from tspd_engine.model.config import ModelConfig
from tspd_engine.model.tokenizer import ByteTokenizer
from tspd_engine.rank.client import EngineClient, RequestStream
from tspd_engine.rank.launch import EngineHandle, launch

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
