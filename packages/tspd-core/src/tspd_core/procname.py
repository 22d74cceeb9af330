"""A process's short name: what ``top``, ``ps -o comm``, ``pgrep`` and ``/proc/<pid>/comm``
show, instead of the ``python`` every tspd process would be (ranks, transfer and encode
workers all run the interpreter, forked from a forkserver whose command line they keep).

Linux keeps up to 15 bytes (``prctl(PR_SET_NAME)``, the calling thread's name, which for the
main thread is the process's); elsewhere, or if the call fails, nothing changes.
"""

from __future__ import annotations

import ctypes
import sys

_PR_SET_NAME = 15
#: Bytes the kernel keeps (TASK_COMM_LEN less the terminating zero).
COMM_BYTES = 15


def set_process_name(name: str) -> bool:
    """Name the calling thread (the process, from its main thread); whether it took."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_NAME, name.encode()[:COMM_BYTES], 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False
