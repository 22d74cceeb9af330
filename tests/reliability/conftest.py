"""Every module of these tests must leave no transfer worker and no server thread behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tspd_testing.loopback import assert_nothing_left_behind


@pytest.fixture(scope="module", autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    yield
    assert_nothing_left_behind()
