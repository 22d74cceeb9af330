"""A process's and a thread's short name: what ``top`` (``-H`` for threads), ``ps -o comm``,
``pgrep`` and ``/proc/<pid>/task/<tid>/comm`` show, instead of the ``python`` every tspd
process and thread would be (ranks, transfer and encode workers all run the interpreter,
forked from a forkserver whose command line they keep; Python before 3.14 gives its threads'
names to nobody but itself)::

    tspd-p-xfer0        a P rank's transfer worker: its main thread (the control loop) and
                        the Mooncake threads it starts, which take its name
      ├─ transfer-0     its transfer threads (their Python names: "tspd-transfer-0", ...)
      ├─ transfer-1
      └─ ZMQbg/IO/0     ZMQ's I/O thread (ZMQ names it)

Linux keeps up to 15 bytes (``prctl(PR_SET_NAME)``, the calling thread's name, which for the
main thread is the process's); elsewhere, or if the call fails, nothing changes.
"""

from __future__ import annotations

import ctypes
import sys
import threading

_PR_SET_NAME = 15
#: Bytes the kernel keeps (TASK_COMM_LEN less the terminating zero).
COMM_BYTES = 15
#: Dropped from a thread's Python name for the system's (its process's name carries it).
THREAD_PREFIX = "tspd-"


def set_process_name(name: str) -> bool:
    """Name the calling thread (the process, from its main thread); whether it took."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_NAME, name.encode()[:COMM_BYTES], 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def name_this_thread() -> bool:
    """Give the calling thread its Python name (``threading.current_thread().name``, less a
    leading ``tspd-``) as its system name: call first thing in a thread's target, or as a
    ``ThreadPoolExecutor``'s initializer. Threads it starts (Mooncake's, ZMQ's) take the
    name too unless they set their own. Whether it took (never on the main thread: its name
    is the process's)."""
    if threading.current_thread() is threading.main_thread():
        return False
    name = threading.current_thread().name
    return set_process_name(name.removeprefix(THREAD_PREFIX))
