"""The native scheduler and its numpy oracle side by side (test helper).

:class:`Twins` builds both on equal pools and stores; :meth:`Twins.call` runs one scheduler
call on both and returns the native result after checking that the oracle's is the same (or
that both raised the same error class); :meth:`Twins.state` of either side is everything a
caller can observe — reference counts, the free stack's order, store entries, the LRU order,
counters, every request's view and page table — which :meth:`Twins.check` compares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import sched_oracle as oracle

from tspd_core.ids import RequestId
from tspd_core.sched import (
    Admission,
    BlockPool,
    CopyOnWrite,
    DecodeRound,
    PrefixKvStore,
    RequestScheduler,
)


class Twins:
    """A native scheduler and the oracle's, driven call for call."""

    def __init__(
        self,
        pages: int,
        capacity: int,
        logical: int,
        page_size: int,
        *,
        store: bool = True,
        max_entries: int | None = None,
    ) -> None:
        self.pool = BlockPool(pages)
        self.store = PrefixKvStore(self.pool, max_entries) if store else None
        self.s = RequestScheduler(
            capacity, logical, page_size=page_size, pool=self.pool, prefixes=self.store
        )
        self.opool = oracle.BlockPool(pages)
        self.ostore = oracle.PrefixKvStore(self.opool, max_entries) if store else None
        self.o = oracle.RequestScheduler(
            capacity, logical, page_size=page_size, pool=self.opool, prefixes=self.ostore
        )
        self.scratch = [self.s.new_round_scratch() for _ in range(2)]
        self.oscratch = [self.o.new_round_scratch() for _ in range(2)]

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``name(*args, **kwargs)`` on both schedulers: the same outcome, or the same error."""
        return self.both(lambda s: getattr(s, name)(*args, **kwargs))

    def both(self, fn: Callable[[Any], Any]) -> Any:
        got, error = _outcome(fn, self.s)
        want, oerror = _outcome(fn, self.o)
        assert type(error) is type(oerror), f"native raised {error!r}, the oracle {oerror!r}"
        if error is not None:
            raise error
        assert comparable(got) == comparable(want), f"native {got!r} != oracle {want!r}"
        return got

    def prepare(self, buffer: int) -> DecodeRound | None:
        """Prepare a round on both into scratch ``buffer`` (0 or 1); None for a shortage."""
        got, error = _outcome(lambda s: s.prepare_decode_round(*self.scratch[buffer][:2]), self.s)
        want, oerror = _outcome(
            lambda s: s.prepare_decode_round(*self.oscratch[buffer][:2]), self.o
        )
        assert type(error) is type(oerror), f"native raised {error!r}, the oracle {oerror!r}"
        if error is not None:
            return None
        assert comparable(got) == comparable(want)
        return got  # type: ignore[no-any-return]

    def check(self) -> None:
        native, model = native_state(self), oracle_state(self)
        assert native == model, _diff(native, model)


def _outcome(fn: Callable[[Any], Any], s: Any) -> tuple[Any, BaseException | None]:
    try:
        return fn(s), None
    except Exception as exc:  # compared by class with the other side's
        return None, exc


def comparable(value: Any) -> Any:
    """``value`` as plain data (arrays as lists, records as tuples), for ``==``."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Admission):
        return (value.request_id, value.slot, value.serial, value.state, value.prompt_len,
                value.prefix_tokens, value.pages.tolist(), value.new_pages.tolist())  # fmt: skip
    if isinstance(value, CopyOnWrite):
        return (value.logical_page, value.src, value.dst)
    if isinstance(value, DecodeRound):
        items = value.items
        columns = [getattr(items, f).tolist() for f in items.__dataclass_fields__]
        return (value.round_id, columns, value.block_table.tolist(), value.copies.tolist(),
                value.new_pages)  # fmt: skip
    if isinstance(value, tuple | list):
        return [comparable(v) for v in value]
    return value


def native_state(t: Twins) -> dict[str, Any]:
    snap = t.pool._snapshot()
    state: dict[str, Any] = {
        "refcounts": snap["refcounts"].tolist(),
        "free_stack": snap["free_stack"].tolist(),
    }
    if t.store is not None:
        store = t.store._snapshot()
        state.update(
            entries=store["entries"], lru=store["lru"], evictable=store["evictable"],
            evicted=store["evicted_total"], cached=len(t.store),
        )  # fmt: skip
    return state | _requests(t.s, list(t.s._snapshot()["index"]))


def oracle_state(t: Twins) -> dict[str, Any]:
    pool = t.opool
    state: dict[str, Any] = {
        "refcounts": pool.refcounts.tolist(),
        "free_stack": pool._free[: pool.free_count()].tolist(),
    }
    if t.ostore is not None:
        store = t.ostore
        queue = store._queue
        pages = queue._pages[queue._head : queue._tail]
        live = store._stamp[pages] == queue._stamps[queue._head : queue._tail]
        state.update(
            entries=store.entries(), lru=pages[live].tolist(),
            evictable=store.evictable_count(), evicted=store.evicted_total, cached=len(store),
        )  # fmt: skip
    return state | _requests(t.o, list(t.o._slots.index))


def _requests(s: Any, rids: list[RequestId]) -> dict[str, Any]:
    views = {rid: (s.view(rid), s.page_table(rid).tolist()) for rid in sorted(rids)}
    return {
        "requests": views,
        "rounds": s.rounds_in_flight(),
        "stats": s.stats(),
        "runnable": _runnable(s),
    }


def _runnable(s: Any) -> list[int]:
    out = np.zeros(s.capacity, dtype=np.int32)
    return out[: s.runnable_into(out)].tolist()


def _diff(a: dict[str, Any], b: dict[str, Any]) -> str:
    return "; ".join(
        f"{k}: native {a.get(k)!r} != oracle {b.get(k)!r}" for k in a if a[k] != b.get(k)
    )


def same(a: object, b: object) -> bool:
    """Deep equality of snapshots (dicts, lists, numpy arrays)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b
