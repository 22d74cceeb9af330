"""tests/interop: TokenSpeed's own Python PD code against tspd's, on this machine.

They run when TokenSpeed's runtime is at ``../shared/interop/tokenspeed`` from the repository
root (CI keeps it there) or where ``TSPD_TOKENSPEED_PYTHON`` names its ``python/`` folder, and
every module skips with one line saying so (and how to point them at a checkout) when neither
is there. The
helpers next to the tests load it (:mod:`tokenspeed_env`), build its contracts
(:mod:`tokenspeed_contracts`), host its managers (:mod:`tokenspeed_host`) and run tspd's side
(:mod:`tspd_side`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tspd_side import ErrorLog


@pytest.fixture(scope="module")
def error_log() -> Iterator[ErrorLog]:
    handler = ErrorLog()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
