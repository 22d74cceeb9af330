"""A P rank's check of the cluster credential's seal on what D ranks send it.

With a credential, a P rank announces ``tspd.auth/1`` at its bootstrap server, and every D
registration and stage offer it accepts must end with a seal frame that verifies over the
message, is fresh (within :data:`~tspd_bootstrap.auth.WINDOW_S` of this host's clock) and was not
seen before (a replayed registration could retire the session of a D that registered anew
from the same socket). Anything else is dropped before any session state is looked at: a
forged registration cannot reject, retire or fail the real session it names.

Control thread only (the replay memory is not locked).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from tspd_bootstrap.auth import FRAMES_DOMAIN, ClusterCredential, CredentialError, ReplayGuard
from tspd_core.pd.errors import FrameError
from tspd_core.pd.metrics.registry import labels
from tspd_core.pd.metrics.worker import WorkerMetrics
from tspd_core.pd.wire.frames import Registration, StageOffer

#: Frames the seal covers: all but the seal frame itself.
_COVERED = {Registration: 8, StageOffer: 6}
_NAMES = {Registration: "registration", StageOffer: "stage_offer"}


class SealCheck:
    """The credential, the replay memory and the refusal counter of one P rank."""

    def __init__(
        self,
        credential: ClusterCredential,
        metrics: WorkerMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.credential = credential
        self._metrics = metrics
        self._guard = ReplayGuard()
        self._clock = clock

    def check(self, msg: Registration | StageOffer, frames: Sequence[bytes]) -> None:
        """Return if ``msg`` (decoded from ``frames``) carries a good seal; else count the
        refusal and raise :class:`FrameError` saying why (the caller drops the message)."""
        kind = type(msg)
        name = _NAMES[kind]
        try:
            if not msg.seal:
                raise CredentialError("unsealed", "no cluster credential seal")
            now = self._clock()
            covered = [bytes(f) for f in frames[: _COVERED[kind]]]
            seal = self.credential.check(FRAMES_DOMAIN, covered, msg.seal, now)
            self._guard.admit(seal, now)
        except CredentialError as exc:
            m = self._metrics
            m.registry.inc(m.refused_seals, at=labels(message=name, reason=exc.code))
            what = name.replace("_", " ")
            raise FrameError(
                f"refused a {what} of D session {msg.session_id}: {exc.message} (this rank "
                "requires the cluster credential)"
            ) from exc
