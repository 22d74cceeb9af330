"""Errors of the PD transfer peers, all rooted at :class:`PdError`.

Each error also subclasses the builtin that matches its meaning, so callers may catch either:
bad input from a peer or a caller is a ``ValueError``, a broken peer or transfer is a
``RuntimeError``. Remote transfer failures that belong to one room are not raised at all: they
come back from ``poll`` as a :class:`~tspd_core.pd.events.Failed` event.
"""

from __future__ import annotations

from tspd_core.errors import TspdError


class PdError(TspdError):
    """Base of every error raised by :mod:`tspd_core.pd`."""


class FrameError(PdError, ValueError):
    """A ZMQ frame (or an engine↔worker message) is malformed: wrong count, size, type or value.

    The peer that receives it logs it and drops it; it never poisons other rooms.
    """


class ConfigError(PdError, ValueError):
    """A peer configuration or an environment variable holds an invalid value."""


class UsageError(PdError, ValueError):
    """A caller used the peer API out of order (unknown request, duplicate register, ...)."""


class TransferError(PdError, RuntimeError):
    """The Mooncake transfer engine refused to start, register memory or write a batch."""


class PeerError(PdError, RuntimeError):
    """A transfer worker process failed to start, died, or the peer is already shut down."""
