"""Callbacks through which other components (the PD peers) join the engine loop.

Every rank runs the same rounds in the same order, so a hook registered on every rank is
called on every rank at the same point of the same round: that is where a PD peer's ``poll``
(whose MIN all-reduce needs all ranks of the replica) belongs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tspd_core.sched import PageArray
from tspd_core.sched.request import Admission

if TYPE_CHECKING:
    from tspd_engine.core import EngineCore


class PdHooks:
    """No-op base; override what you need. Called on the engine thread, never concurrently.

    Ordering: ``on_round`` first in every round (before admission); ``on_remote_admitted``
    right after the scheduler admits a REMOTE_DECODE request; ``on_prefill_done`` right after a
    PREFILL_ONLY request's prompt KV is complete and its first token is known.
    """

    def on_round(self, core: EngineCore) -> None:
        """Start of every round: poll transfers, then call ``core.start_remote_decode`` /
        ``core.release_prefill`` / ``core.abort`` for the rooms that moved."""

    def on_remote_admitted(self, rid: str, admission: Admission) -> None:
        """A decode-side request holds its pages (``admission.pages``); the pages past its
        prefix hit (``admission.new_pages``) must be zeroed before KV is requested."""

    def on_prefill_done(self, rid: str, first_token: int, pages: PageArray) -> None:
        """A prefill-side request is done; ``pages`` (its page table) stay held until
        ``core.release_prefill(rid)``."""
