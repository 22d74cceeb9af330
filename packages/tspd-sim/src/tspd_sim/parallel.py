"""Where a sweep's points run: processes on this machine, or tasks of a Ray cluster.

A point (a grid configuration's capacity search, a compare variant's replay) is a pure
function of its inputs: :func:`run_points` runs ``fn(item, shared)`` for each item and returns
the results in the items' order, whatever ran them and in whatever order they finished, so a
sweep's table is the same locally and on Ray for the same inputs.

* **Local** (``ray_address`` None): a ``ProcessPoolExecutor`` of ``workers`` processes (in this
  process when 1); ``shared`` (the trace) is pickled with each point.
* **Ray** (``ray_address``: ``HOST:PORT`` of a running cluster's head, or ``auto``): the
  driver connects with ``ray.init`` (and disconnects afterwards if it connected), puts
  ``shared`` in the object store once, and submits one task per point (one CPU each). A task
  whose worker process or node dies is run again elsewhere, up to :data:`RAY_RETRIES` times
  (Ray's system-failure retries); an error the point itself raises (a configuration that
  cannot work) is not retried and propagates as that error. Every node must have the same
  tspd-sim installed (the tasks import ``fn`` by its module). Ray is the optional extra
  ``tspd-sim[ray]``, imported only here and only for a Ray run.

Progress: a bar on stderr (``progress``) advances as points finish; ``on_done`` is called
with each result as it finishes, in completion order, on the caller's thread.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from typing import Any, TypeVar

from tqdm import tqdm

from tspd_sim.errors import SimError

T = TypeVar("T")
R = TypeVar("R")
S = TypeVar("S")

#: Times a Ray task is run again after its worker or node died (then the sweep fails).
RAY_RETRIES = 3
#: Seconds the head's address has to accept a connection before a Ray run is refused.
CONNECT_TIMEOUT_S = 5.0


class RayUnavailableError(SimError, RuntimeError):
    """``--ray`` was given where Ray is not installed, or its cluster cannot be reached."""


def run_points(
    fn: Callable[[T, S], R],
    items: Sequence[T],
    shared: S,
    *,
    workers: int | None = None,
    ray_address: str | None = None,
    progress: bool = False,
    on_done: Callable[[R], None] | None = None,
    what: str = "points",
) -> list[R]:
    """``[fn(item, shared) for item in items]``, run in parallel (module docstring)."""
    # Redrawn at every point (tqdm's default skips updates 0.1 s apart): points take seconds.
    bar = tqdm(total=len(items), desc=what, unit="pt", disable=not progress, leave=False,
               mininterval=0, miniters=1)  # fmt: skip
    results: dict[int, R] = {}

    def finished(index: int, result: R) -> None:
        results[index] = result
        bar.update(1)
        if on_done is not None:
            on_done(result)

    try:
        if ray_address is not None:
            _on_ray(fn, items, shared, ray_address, finished)
        else:
            _locally(fn, items, shared, workers, finished)
    finally:
        bar.close()
    return [results[i] for i in range(len(items))]


def _locally(
    fn: Callable[[T, S], R],
    items: Sequence[T],
    shared: S,
    workers: int | None,
    finished: Callable[[int, R], None],
) -> None:
    n = min(len(items), workers or os.cpu_count() or 1)
    if n <= 1:
        for i, item in enumerate(items):
            finished(i, fn(item, shared))
        return
    with ProcessPoolExecutor(max_workers=n) as pool:
        futures: dict[Future[R], int] = {
            pool.submit(fn, item, shared): i for i, item in enumerate(items)
        }
        for future in as_completed(futures):
            finished(futures[future], future.result())


def _on_ray(
    fn: Callable[[T, S], R],
    items: Sequence[T],
    shared: S,
    address: str,
    finished: Callable[[int, R], None],
) -> None:
    ray = _ray()
    connected = not ray.is_initialized()
    if connected:
        _check_reachable(address)
        try:
            ray.init(address=address, log_to_driver=False, logging_level="warning")
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RayUnavailableError(f"cannot reach the Ray cluster at {address}: {exc}") from exc
    try:
        task = ray.remote(num_cpus=1, max_retries=RAY_RETRIES, retry_exceptions=False)(fn)
        shared_ref = ray.put(shared)
        pending: dict[Any, int] = {task.remote(item, shared_ref): i for i, item in enumerate(items)}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                # A point's own error arrives as a RayTaskError that is also an instance of
                # the point's exception class (SpecError, ...): callers catch it as such.
                finished(pending.pop(ref), ray.get(ref))
    finally:
        if connected:
            ray.shutdown()


def _check_reachable(address: str) -> None:
    """Refuse a head that does not answer a TCP connect within :data:`CONNECT_TIMEOUT_S`
    (``ray.init`` itself retries an unreachable address for minutes); ``auto`` is Ray's to
    find."""
    if address == "auto":
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise RayUnavailableError(f"--ray {address!r}: give the head's HOST:PORT, or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise RayUnavailableError(f"cannot reach the Ray cluster at {address}: {exc}") from exc


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailableError(
            "--ray needs Ray: install tspd-sim's extra, pip install 'tspd-sim[ray]'"
        ) from exc
    return ray
