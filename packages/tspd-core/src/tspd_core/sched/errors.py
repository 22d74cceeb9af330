"""Errors of the request scheduler (``tspd_core.sched``).

Every error names the request (or the resource) at fault and says what the caller can do.
Each class also subclasses the builtin that matches its meaning, so callers may catch either:
caller mistakes are ``ValueError`` / ``LookupError``; running out of a resource or calling in
the wrong lifecycle state is ``RuntimeError``.

Expected shortage is not an error where the caller asked for a ``try_*`` variant: those return
``None`` instead of raising :class:`CapacityFull` or :class:`PoolExhausted`.
"""

from __future__ import annotations

from tspd_core.errors import TspdError


class SchedulerError(TspdError):
    """Base of every error the scheduler, block pool and prefix store raise."""


class InvalidInput(SchedulerError, ValueError):
    """An argument is malformed (negative count, page out of range, scratch too small...)."""


class DuplicateRequest(SchedulerError, ValueError):
    """A request id is admitted while a request with the same id is still active."""


class UnknownRequest(SchedulerError, LookupError):
    """The request id is not active (never admitted, or already finished)."""


class CapacityFull(SchedulerError, RuntimeError):
    """Every request slot is taken; finish a request before admitting another."""


class PoolExhausted(SchedulerError, RuntimeError):
    """The block pool (after evicting unreferenced prefix pages) cannot supply enough pages."""


class WrongState(SchedulerError, RuntimeError):
    """The operation does not apply to the request's current lifecycle state."""


class ContextFull(SchedulerError, RuntimeError):
    """A request reached its maximum context (logical_pages x page_size tokens)."""


class BackendMismatch(SchedulerError, RuntimeError):
    """A decode backend's outputs do not match the batch it was given (count, ids or order)."""
