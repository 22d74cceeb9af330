"""A test rank's arena on its device, with the host bytes the identity oracle reads and writes.

The oracles (:mod:`tspd_testing.identity`) work on numpy arrays. On CPU the arena is one
shared-memory tensor and its numpy view *is* the arena, so :meth:`DeviceArena.push` and
:meth:`DeviceArena.pull` do nothing. On CUDA the arena lives in device memory (shared with the
transfer worker through a CUDA IPC handle) and ``host`` is a separate copy::

    oracle writes host ── push(mask) ──► arena (device) ◄── Mooncake writes (worker process)
    oracle reads  host ◄── pull() ────── arena (device)

``push`` copies only the bytes a mask selects, so a D rank that fills a prefix page never
overwrites pages a P worker is writing at the same time; both copies are synchronous (the
bytes are on the device, or on the host, when the call returns).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch


class DeviceArena:
    """One rank's arena (``arena``, on ``device``) and its host copy (``host``)."""

    def __init__(self, nbytes: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.arena = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        if self.arena.is_cuda:
            self.host = torch.zeros(nbytes, dtype=torch.uint8)
        else:
            self.arena.share_memory_()  # type: ignore[no-untyped-call]
            self.host = self.arena

    @property
    def mirrored(self) -> bool:
        """Whether ``host`` is a copy (CUDA) rather than the arena itself (CPU)."""
        return self.host is not self.arena

    def numpy(self) -> npt.NDArray[np.uint8]:
        """The host bytes as numpy (a view: writes land in ``host``)."""
        out: npt.NDArray[np.uint8] = self.host.numpy()
        return out

    def push(self, mask: npt.NDArray[np.bool_] | None = None) -> None:
        """Host bytes → device: those ``mask`` selects, or all of them."""
        if not self.mirrored:
            return
        if mask is None:
            self.arena.copy_(self.host)
            return
        index = torch.from_numpy(np.flatnonzero(mask))
        self.arena[index.to(self.device)] = self.host[index].to(self.device)
        torch.cuda.current_stream(self.device).synchronize()

    def pull(self) -> None:
        """Device bytes → host (all of them)."""
        if self.mirrored:
            self.host.copy_(self.arena)
