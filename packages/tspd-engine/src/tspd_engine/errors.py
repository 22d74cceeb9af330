"""The reference engine's own errors, below the serving pieces' root
(:class:`tspd_serving.errors.ServingError`).

Bad configuration, model files and request input raise :mod:`tspd_serving.errors`' classes
(``ConfigError``, ``CheckpointError``, ``RequestError``, ``TemplateError``: the router raises
them too); what only an engine can fail at is here. Each also subclasses the builtin that
matches its meaning, so callers may catch either: a dead rank or broken process group is a
``RuntimeError``. A full block pool is not an error: the scheduler keeps the request waiting.
"""

from __future__ import annotations

from tspd_serving.errors import ServingError


class EngineError(ServingError):
    """Base of the errors only the reference engine raises."""


class EngineDeadError(EngineError, RuntimeError):
    """The engine's rank processes exited or stopped answering; pending requests are failed."""


class NodeBusyError(EngineError, RuntimeError):
    """A node holds as many requests as it may (running + queued): this one was refused before
    it reached the engine, and may be sent again later or elsewhere (HTTP 503, ``busy``)."""
