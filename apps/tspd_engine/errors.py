"""Errors of the reference engine, rooted at :class:`tspd_core.errors.TspdError`.

Each also subclasses the builtin that matches its meaning, so callers may catch either:
bad configuration or request input is a ``ValueError``; a dead rank or broken process group is
a ``RuntimeError``. A full block pool is not an error: the scheduler keeps the request waiting.
"""

from __future__ import annotations

from tspd_core.errors import TspdError


class EngineError(TspdError):
    """Base of every error the reference engine raises on purpose."""


class ConfigError(EngineError, ValueError):
    """A model or engine configuration is inconsistent (e.g. heads not divisible by TP)."""


class CheckpointError(EngineError, ValueError):
    """A checkpoint directory is missing files, tensors, or has tensors of the wrong shape."""


class RequestError(EngineError, ValueError):
    """A request is malformed (empty prompt, token id out of range, too long for the cache)."""


class EngineDeadError(EngineError, RuntimeError):
    """The engine's rank processes exited or stopped answering; pending requests are failed."""


class NodeBusyError(EngineError, RuntimeError):
    """A node holds as many requests as it may (running + queued): this one was refused before
    it reached the engine, and may be sent again later or elsewhere (HTTP 503, ``busy``)."""


class TemplateError(RequestError):
    """A chat template refused a conversation (``raise_exception``) or could not render it."""
