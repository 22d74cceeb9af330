"""tspd's reference engine: a small Llama-style decoder over a paged KV arena, tensor parallel
across rank processes, driven by tspd_core's request scheduler and device token feed.

See docs/engine.md. The front doors: :class:`Engine` (one rank, in-process),
:func:`launch` → :class:`EngineHandle` with an :class:`EngineClient` (rank processes), and
``python -m tspd_engine {generate,serve}``.
"""

from tspd_engine.client import EngineClient, RequestStream
from tspd_engine.config import EngineConfig, ModelConfig
from tspd_engine.core import EngineCore
from tspd_engine.engine import Engine
from tspd_engine.frames import FinishReason, Output, RequestMode, SamplingParams
from tspd_engine.hooks import PdHooks
from tspd_engine.launch import EngineHandle, launch
from tspd_engine.tokenizer import ByteTokenizer

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
