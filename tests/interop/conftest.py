"""tests/interop: TokenSpeed's own Python PD code against tspd's, on this machine.

They run when TokenSpeed's runtime is at ``../shared/interop/tokenspeed`` from the repository
root (CI keeps it there) or where ``TSPD_TOKENSPEED_PYTHON`` names its ``python/`` folder, and
every module skips with one line saying so (and how to point them at a checkout) when neither
is there. The
helpers, shared with the benchmarks, are ``tspd_testing.interop``: they load it (``env``),
build its contracts (``contracts``), host its managers (``host``), run tspd's side
(``tspd_side``) and time whole pairs of either system (``pairs``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tspd_testing.interop.tspd_side import ErrorLog


@pytest.fixture(scope="module")
def error_log() -> Iterator[ErrorLog]:
    handler = ErrorLog()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
