"""Logs of the transfer workers, routed into the engine process through multiprocessing-logging.

``install_mp_handler`` only supports the ``fork`` start method, and a transfer worker must not
be forked from an engine that initialised CUDA. So the engine process keeps one
:class:`multiprocessing_logging.MultiProcessingHandler` as the *receiver* (its thread drains a
queue made by the worker's start context), and each worker puts its records on that queue with
a stdlib ``QueueHandler``. The receiver re-dispatches every record to the engine's logger of the
same name, so worker records meet the engine's own handlers, levels and filters (and pytest's
``caplog``) exactly as if they were logged in the engine.

    worker: logger -> QueueHandler ──queue──> engine: MultiProcessingHandler thread
                                                 -> logging.getLogger(record.name).handle()
"""

from __future__ import annotations

import logging
import logging.handlers
import multiprocessing.context
import threading
from typing import Any

import multiprocessing_logging

_sinks: dict[str, _Sink] = {}
_lock = threading.Lock()


class _Redispatch(logging.Handler):
    """Hands a record from a worker to the engine logger of the same name."""

    def emit(self, record: logging.LogRecord) -> None:
        logger = logging.getLogger(record.name)
        if logger.isEnabledFor(record.levelno):
            logger.handle(record)


class _Sink(multiprocessing_logging.MultiProcessingHandler):  # type: ignore[misc]
    """The library's receiver, with its queue made by the workers' start context."""

    _ctx_queue: Any = None

    def __init__(self, ctx: multiprocessing.context.BaseContext) -> None:
        # The base constructor assigns ``self.queue`` from the default (fork) context and starts
        # the thread that reads it; the property below makes both use our context's queue.
        self._ctx_queue = ctx.Queue(-1)
        super().__init__(f"tspd-pd-logs-{ctx.get_start_method()}", sub_handler=_Redispatch())

    @property
    def queue(self) -> Any:
        return self._ctx_queue

    @queue.setter
    def queue(self, _unused: Any) -> None:
        pass


def log_queue(ctx: multiprocessing.context.BaseContext) -> Any:
    """The queue workers of ``ctx`` log into (one receiver per start method per process)."""
    method = ctx.get_start_method()
    with _lock:
        sink = _sinks.get(method)
        if sink is None:
            sink = _sinks[method] = _Sink(ctx)
        return sink.queue


def install_worker_logging(queue: Any, level: int) -> None:
    """In a worker: send every record at ``level`` or above to the engine process."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(logging.handlers.QueueHandler(queue))
    root.setLevel(level)
