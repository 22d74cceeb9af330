"""A probe worker: the arena sharing of a transfer worker, with nothing else in the way.

A transfer worker receives its rank's arena (and a P rank's step-counter word) through
:class:`~tspd_core.pd.proc.handle.ProcessHandle` — torch's multiprocessing reductions: a shared
memory descriptor on CPU, a CUDA IPC handle on GPU. When a PD transfer goes wrong on a GPU, this
probe tells whether the sharing itself works: it is started by the same ``ProcessHandle.spawn``
(``forkserver``, the same pipes), maps the same kinds of tensors, and on command writes bytes
into the arena, reads them back, or reads the counter word::

    test (engine side)                           probe worker
    ProcessHandle.spawn(arena, ProbeSpec) ─────► maps the arena (IPC) and the counter word
                 ◄──────────── ProbeReady(device, bytes)
    ProbeFill(offset, length, seed) ───────────► arena[offset:+length] = pattern; synchronize
                 ◄──────────── ProbeAnswer("filled")
    ProbeDigest(offset, length) ───────────────► sha256 of the bytes it sees
    ProbeCounter() ────────────────────────────► the counter word as a CounterReader sees it
    ProbeWhere(env) ───────────────────────────► its pid, its parent's, and one variable of
                                                 its environment (JSON)

:func:`relay` is a process between the two (a rank starting its worker): it adopts a
forkserver (:mod:`tspd_core.pd.proc.forkserver`), starts a probe, and reports what it saw.

Messages are JSON (a tag and scalars); the pipe carries nothing else. For tests only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing.connection as mpc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tspd_core.pd.layerwise.step_counter import CounterReader
from tspd_core.pd.proc import forkserver
from tspd_core.pd.proc.handle import ProcessHandle, WorkerKind


@dataclass(frozen=True, slots=True)
class ProbeSpec:
    """What the probe maps besides the arena: a step counter's shared host word, if any."""

    counter: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class ProbeReady:
    device: str  #: the arena's device as the worker sees it
    nbytes: int


@dataclass(frozen=True, slots=True)
class ProbeFill:
    offset: int
    length: int
    seed: int


@dataclass(frozen=True, slots=True)
class ProbeDigest:
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class ProbeCounter:
    pass


@dataclass(frozen=True, slots=True)
class ProbeWhere:
    env: str  #: the environment variable to report


@dataclass(frozen=True, slots=True)
class ProbeStop:
    pass


@dataclass(frozen=True, slots=True)
class ProbeAnswer:
    value: str


ProbeMsg = (
    ProbeReady | ProbeFill | ProbeDigest | ProbeCounter | ProbeWhere | ProbeStop | ProbeAnswer
)
_TYPES: dict[str, type[Any]] = {
    t.__name__: t
    for t in (ProbeReady, ProbeFill, ProbeDigest, ProbeCounter, ProbeWhere, ProbeStop, ProbeAnswer)
}


def encode(msg: ProbeMsg) -> bytes:
    return json.dumps({"t": type(msg).__name__, **dataclasses.asdict(msg)}).encode()


def decode(buf: bytes) -> ProbeMsg:
    body = json.loads(buf)
    kind: ProbeMsg = _TYPES[body.pop("t")](**body)
    return kind


PROBE: WorkerKind[ProbeMsg, ProbeReady] = WorkerKind(
    "ipc probe", encode, decode, ProbeReady, ProbeStop()
)


def pattern(length: int, seed: int) -> npt.NDArray[np.uint8]:
    """The bytes a fill of ``seed`` writes: distinct per seed, offset and length (mod 251)."""
    return ((np.arange(length, dtype=np.int64) * 131 + seed * 17 + 1) % 251).astype(np.uint8)


def digest(data: torch.Tensor) -> str:
    """sha256 of a uint8 tensor's bytes (copied to the host first)."""
    return hashlib.sha256(data.cpu().numpy().tobytes()).hexdigest()


def start(
    arena: torch.Tensor, spec: ProbeSpec, timeout_s: float = 120.0
) -> ProcessHandle[Any, Any]:
    """Start a probe over ``arena`` the way a transfer worker is started (``forkserver``)."""
    return ProcessHandle.spawn(PROBE, main, spec, arena, "tspd-ipc-probe", "forkserver", timeout_s)


def ask(probe: ProcessHandle[Any, Any], msg: ProbeMsg, timeout_s: float = 60.0) -> str:
    """Send one command and return the probe's answer."""
    probe.send(msg)
    if not probe.wait(timeout_s):
        raise TimeoutError(f"the ipc probe did not answer {msg} within {timeout_s:g} s")
    (answer,) = probe.drain()
    assert isinstance(answer, ProbeAnswer), answer
    return answer.value


def main(
    spec: ProbeSpec, arena: torch.Tensor, commands: mpc.Connection, notes: mpc.Connection, _: Any
) -> None:
    """The probe process: answer commands until ProbeStop (or the engine's end closes)."""
    reader = CounterReader(spec.counter) if spec.counter is not None else None
    notes.send_bytes(encode(ProbeReady(str(arena.device), arena.numel())))
    while True:
        try:
            msg = decode(commands.recv_bytes())
        except EOFError:
            return
        if isinstance(msg, ProbeStop):
            return
        notes.send_bytes(encode(ProbeAnswer(_answer(msg, arena, reader))))


def _answer(msg: ProbeMsg, arena: torch.Tensor, reader: CounterReader | None) -> str:
    if isinstance(msg, ProbeFill):
        data = torch.from_numpy(pattern(msg.length, msg.seed)).to(arena.device)
        arena[msg.offset : msg.offset + msg.length] = data
        if arena.is_cuda:
            torch.cuda.synchronize(arena.device)  # on the device before the engine reads
        return "filled"
    if isinstance(msg, ProbeDigest):
        return digest(arena[msg.offset : msg.offset + msg.length])
    if isinstance(msg, ProbeCounter):
        return "no counter" if reader is None else str(reader.value())
    if isinstance(msg, ProbeWhere):
        return json.dumps([os.getpid(), os.getppid(), os.environ.get(msg.env)])
    return f"unexpected {type(msg).__name__}"


def relay(server: forkserver.Server | None, env: str, out: mpc.Connection) -> None:
    """A process that starts a probe, as a rank starts its transfer worker: adopt ``server``,
    start a probe over a small arena, ask it :class:`ProbeWhere`, and send back
    ``[adopted, [pid, ppid, value], this process's children]`` (the children read while the
    probe runs: a process that started a forkserver of its own has it among them)."""
    adopted = forkserver.adopt(server)
    probe = start(torch.zeros(64, dtype=torch.uint8), ProbeSpec(), timeout_s=60.0)
    try:
        where = json.loads(ask(probe, ProbeWhere(env)))
        children = sorted(_children(os.getpid()))
    finally:
        probe.close()
    out.send([adopted, where, children])


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue  # exited while we read
        if stat and int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
            found.append(int(entry.name))
    return found
