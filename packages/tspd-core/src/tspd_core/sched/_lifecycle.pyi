"""Type stub of the scheduler's native request lifecycle (``_lifecycle.pyx``)."""

from numpy.typing import ArrayLike

from tspd_core.ids import RequestId
from tspd_core.sched._slots import Slots
from tspd_core.sched.request import Admission, CopyOnWrite

class Lifecycle(Slots):
    def admit(
        self,
        request_id: RequestId,
        prompt_len: int,
        page_keys: ArrayLike | None = None,
        *,
        remote_kv: bool = False,
    ) -> Admission: ...
    def try_admit(
        self,
        request_id: RequestId,
        prompt_len: int,
        page_keys: ArrayLike | None = None,
        *,
        remote_kv: bool = False,
        headroom: int = 0,
    ) -> Admission | None: ...
    def advance_prefill(self, request_id: RequestId, num_tokens: int) -> int: ...
    def mark_prefill_complete(self, request_id: RequestId) -> None: ...
    def seed_decode_token(self, request_id: RequestId, token: int) -> None: ...
    def record_token(self, request_id: RequestId, token: int) -> CopyOnWrite | None: ...
    def record_tokens(
        self, request_id: RequestId, tokens: int | ArrayLike
    ) -> CopyOnWrite | None: ...
    def ensure_writable(self, request_id: RequestId, logical_page: int) -> CopyOnWrite | None: ...
    def fork(self, parent_id: RequestId, child_id: RequestId) -> Admission: ...
    def finish(self, request_id: RequestId) -> None: ...
