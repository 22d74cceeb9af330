"""Errors of the serving pieces, and the root of the engine's (``tspd_engine.errors``).

Each also subclasses the builtin that matches its meaning, so callers may catch either: bad
configuration, a bad model file or bad request input is a ``ValueError``. This package imports
no other tspd package (the router installs it without the engine or tspd-core's PD half), so
the hierarchy is rooted here rather than at ``tspd_core.errors.TspdError``.
"""

from __future__ import annotations


class ServingError(Exception):
    """Base of every error the serving pieces and the reference engine raise on purpose."""


class ConfigError(ServingError, ValueError):
    """A model or engine configuration is inconsistent (e.g. heads not divisible by TP)."""


class CheckpointError(ServingError, ValueError):
    """A checkpoint directory is missing files, tensors, or has tensors of the wrong shape."""


class RequestError(ServingError, ValueError):
    """A request is malformed (empty prompt, token id out of range, too long for the cache)."""


class TemplateError(RequestError):
    """A chat template refused a conversation (``raise_exception``) or could not render it."""
