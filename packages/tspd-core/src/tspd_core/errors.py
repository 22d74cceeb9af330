"""Root of tspd_core's exception hierarchy.

Each subpackage defines its own errors below :class:`TspdError`, each also subclassing the
builtin that matches its meaning (``ValueError`` for bad input, ``RuntimeError`` for a broken
peer, ...), so callers may catch either. Expected shortage is not an error: it returns ``None``.
"""


class TspdError(Exception):
    """Base of every error tspd_core raises on purpose."""
