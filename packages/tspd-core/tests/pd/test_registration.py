"""A P rank's bootstrap entry against a real server: waiting out a previous run's lease,
renewing, and coming back by itself after the server restarted."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from tspd_bootstrap import (
    LEASE_EXTENSION,
    BootstrapClient,
    BootstrapConflict,
    BootstrapServer,
    RankAddress,
)
from tspd_core.layout import ArenaSpec, build_contract, canonical_layout_text, encode_contract
from tspd_core.pd.prefill.registration import RankRegistration, RankSpec

SPEC = ArenaSpec(layers=1, kv_heads=2, head_dim=8, num_pages=8)
LAYOUT = canonical_layout_text(encode_contract(build_contract(SPEC)).decode())


def _spec(port: int) -> RankSpec:
    return RankSpec(0, 1, 1, "127.0.0.1", port, LAYOUT, (LEASE_EXTENSION,))


def _wait(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def test_the_first_registration_waits_out_a_previous_runs_lease() -> None:
    clock = Clock()
    with BootstrapServer("127.0.0.1", 0, layout_canonicalizer=str, clock=clock) as server:
        RankRegistration(server.url, _spec(30000)).register()  # the previous run
        clock.now += 19.2  # its lease lapses in 0.8 s of the server's time
        restarted = RankRegistration(server.url, _spec(30001))
        done = threading.Thread(target=restarted.register, kwargs={"wait_s": 5.0})
        done.start()
        held = 'tspd_bootstrap_errors_total{status="409",reason="rank_held"} 1'
        with BootstrapClient(server.url) as probe:
            _wait(lambda: held in _metrics(probe), "the first 409")
            clock.now += 1.0  # lapsed: the retry (after Retry-After: 1 s) gets in
            done.join(10)
            assert not done.is_alive()
            assert probe.rank_address(0, 0) == RankAddress("127.0.0.1", 30001, (LEASE_EXTENSION,))
        restarted.close()
        # A holder without a lease (no Retry-After): refused at once, with the reason.
        RankRegistration(server.url, RankSpec(0, 1, 1, "127.0.0.1", 30001, LAYOUT, ())).register()
        started = time.monotonic()
        with pytest.raises(BootstrapConflict, match="registered without a lease") as info:
            RankRegistration(server.url, _spec(30002)).register(wait_s=5.0)
        assert info.value.retry_after is None
        assert time.monotonic() - started < 5.0  # less than the wait_s it would have spent


def _metrics(client: BootstrapClient) -> str:
    session = client._session()  # the client's own keep-alive session: no other dependency
    return str(session.get(client.base_url + "/metrics", timeout=5).text)


def test_renewals_keep_the_lease_and_register_again_with_a_restarted_server() -> None:
    server = BootstrapServer("127.0.0.1", 0, layout_canonicalizer=str).start()
    port = server.port
    registration = RankRegistration(server.url, _spec(30100))
    registration.register()
    registration.start_renewing(every_s=0.1)
    try:
        _wait(lambda: server.snapshot().ranks[0].registrations >= 3, "two renewals")
        server.close()  # a standalone server restarts: it has forgotten the rank
        server = BootstrapServer("127.0.0.1", port, layout_canonicalizer=str).start()
        assert server.snapshot().ranks == ()
        _wait(lambda: len(server.snapshot().ranks) == 1, "the rank to register again")
        assert server.snapshot().ranks[0].address == RankAddress(
            "127.0.0.1", 30100, (LEASE_EXTENSION,)
        )
    finally:
        registration.close()
        server.close()
