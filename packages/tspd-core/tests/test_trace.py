"""tspd_core.trace: stamps off by default, exact lines when on, one file per process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tspd_core import trace


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[Path]:
    directory = trace.enable(tmp_path / "stamps")
    try:
        yield directory
    finally:
        trace.disable()
        trace.label("")


def _fields(stamps: list[trace.Stamp]) -> list[tuple[str, str, str, str, str]]:
    return [(s.label, s.thread, s.key, s.what, s.extra) for s in stamps]


def test_off_by_default_writes_nothing(tmp_path: Path) -> None:
    assert os.environ.get(trace.ENV) is None
    assert not trace.enabled()
    trace.mark("r1", "step")
    trace.mark_room(5, "step")
    assert list(tmp_path.iterdir()) == []


def test_stamps_read_back_exactly_in_order(traced: Path) -> None:
    trace.label("decode-rank0")
    trace.mark("r1", "node.submit", "decode")
    trace.mark_room(77, "dw.cmd", "TrackRoom")
    trace.mark("r1", "rank.send")
    stamps = trace.read(traced)
    assert _fields(stamps) == [
        ("decode-rank0", "MainThread", "r1", "node.submit", "decode"),
        ("decode-rank0", "MainThread", "room:77", "dw.cmd", "TrackRoom"),
        ("decode-rank0", "MainThread", "r1", "rank.send", ""),
    ]
    assert [s.pid for s in stamps] == [os.getpid()] * 3
    assert stamps[0].t_ns <= stamps[1].t_ns <= stamps[2].t_ns
    assert [p.name for p in traced.iterdir()] == [f"{os.getpid()}.tsv"]


def test_a_hostile_key_cannot_break_the_line_format(traced: Path) -> None:
    trace.mark("evil\tid\nwith breaks", "node.submit", "x\ty")
    (stamp,) = trace.read(traced)
    assert (stamp.key, stamp.what, stamp.extra) == ("evil id with breaks", "node.submit", "x y")


def test_stamps_from_other_threads_name_their_thread(traced: Path) -> None:
    worker = threading.Thread(target=trace.mark, args=("r2", "w.step"), name="tspd-transfer-0")
    worker.start()
    worker.join()
    assert _fields(trace.read(traced)) == [("", "tspd-transfer-0", "r2", "w.step", "")]


def test_a_started_process_inherits_tracing_and_writes_its_own_file(traced: Path) -> None:
    code = "from tspd_core import trace; trace.label('child'); trace.mark('r3', 'child.step')"
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    assert done.returncode == 0
    trace.mark("r3", "parent.step")
    stamps = trace.read(traced)
    assert sorted(_fields(stamps)) == [
        ("", "MainThread", "r3", "parent.step", ""),
        ("child", "MainThread", "r3", "child.step", ""),
    ]
    assert len({s.pid for s in stamps}) == 2
    assert len(list(traced.glob("*.tsv"))) == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_writes_its_own_file(traced: Path) -> None:
    pid = os.fork()
    if pid == 0:  # the child: stamp and leave at once (no pytest teardown here)
        trace.mark("r4", "forked.step")
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    (stamp,) = trace.read(traced)
    assert (stamp.pid, stamp.key, stamp.what) == (pid, "r4", "forked.step")


def test_disable_stops_stamps_here_and_in_later_children(traced: Path) -> None:
    trace.mark("r5", "before")
    trace.disable()
    assert not trace.enabled()
    assert trace.ENV not in os.environ
    trace.mark("r5", "after")
    code = "from tspd_core import trace; trace.mark('r5', 'child')"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert [s.what for s in trace.read(traced)] == ["before"]


def test_read_skips_malformed_lines(traced: Path) -> None:
    trace.mark("r6", "ok")
    with open(traced / "junk.tsv", "w") as f:
        f.write("not a stamp\n12\tonly\tthree\n")
    assert [s.what for s in trace.read(traced)] == ["ok"]
