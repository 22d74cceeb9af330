"""Type stub of the compiled short path (``_lives.c``; see :mod:`tspd_core.sched.short`)."""

from typing import Any

from tspd_core.ids import RequestId
from tspd_core.sched.request import Admission, RequestState

class Lives:
    def __init__(
        self,
        pool: Any,
        store: Any,
        slots: Any,
        admission: type[Admission],
        page_size: int,
    ) -> None: ...
    def admit(
        self,
        sched: Any,
        request_id: RequestId,
        prompt_len: int,
        keys: list[int],
        state: RequestState,
        headroom: int,
        need: int,
    ) -> Any: ...  # Admission, None (a shortage) or NotImplemented (a strict pool)
    def complete(self, slot: int) -> Any: ...  # None or NotImplemented
    def finish(self, slot: int) -> Any: ...  # None or NotImplemented
