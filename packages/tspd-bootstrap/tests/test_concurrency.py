"""64 concurrent clients registering and looking up against one real server."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import requests

from tspd_bootstrap import (
    BootstrapClient,
    BootstrapNotFound,
    BootstrapServer,
    ClusterCredential,
    ParallelInfo,
    RankAddress,
)

pytestmark = pytest.mark.slow
DP, TP = 8, 8
WORLD = DP * TP  # 64 ranks, one client thread each


def address(rank: int, generation: int) -> RankAddress:
    return RankAddress(f"10.{generation}.{rank // 8}.{rank % 8}", 20000 + 100 * generation + rank)


def run_all(target: Callable[[int], object]) -> list[object]:
    """Run ``target(rank)`` on WORLD threads released together; return results or errors."""
    results: list[object] = [None] * WORLD
    gate = threading.Barrier(WORLD)

    def body(rank: int) -> None:
        gate.wait()
        try:
            results[rank] = target(rank)
        except BaseException as exc:  # reported by the assertions below
            results[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def register(client: BootstrapClient, rank: int, layout: str, generation: int) -> None:
    where = address(rank, generation)
    client.register_rank(
        engine_rank=rank,
        world_size=WORLD,
        dp_size=DP,
        rank_ip=where.rank_ip,
        rank_port=where.rank_port,
        cache_layout=layout,
    )


def table(client: BootstrapClient) -> dict[tuple[int, int], RankAddress]:
    return {(dp, tp): client.rank_address(tp, dp) for dp in range(DP) for tp in range(TP)}


def test_64_clients_register_and_agree(server: BootstrapServer, layout: str) -> None:
    def join(rank: int) -> tuple[ParallelInfo | None, dict[tuple[int, int], RankAddress]]:
        with BootstrapClient(server.url, retries=2) as client:
            register(client, rank, layout, generation=0)
            deadline = time.monotonic() + 30
            while True:  # wait for the deployment: wire.md §3.3's 500 until every rank is in
                try:
                    return client.parallel_info(), table(client)
                except BootstrapNotFound:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)

    results = run_all(join)
    expected = {(r // TP, r % TP): address(r, 0) for r in range(WORLD)}
    for result in results:
        assert result == (ParallelInfo(WORLD, DP, layout), expected)
    metrics = requests.get(f"{server.url}/metrics", timeout=5).text
    assert 'tspd_bootstrap_registrations_total{role="Prefill"} 64\n' in metrics
    assert "tspd_bootstrap_reregistrations_total 0\n" in metrics
    assert "tspd_bootstrap_deployment_complete 1\n" in metrics


def test_restarts_during_lookups_never_yield_a_foreign_address(layout: str) -> None:
    # Restarted ranks move to new addresses at once only with the cluster credential.
    credential = ClusterCredential(b"a test cluster token, 32 bytes.")
    with (
        BootstrapServer("127.0.0.1", 0, credential=credential) as server,
        BootstrapClient(server.url, credential=credential) as setup,
    ):
        for rank in range(WORLD):
            register(setup, rank, layout, generation=0)
        churned = run_all(lambda rank: churn(server, credential, layout, rank))
        view = server.snapshot()
    for rank, seen in enumerate(churned):
        allowed = {address(rank, 0), address(rank, 1)} if rank % 2 else {address(rank, 0)}
        assert isinstance(seen, set), seen
        assert seen
        assert seen <= allowed
        # Each thread looks up its own rank after its own (re-)registration: only that one.
        assert seen == {address(rank, rank % 2)}
    assert view.complete
    for entry in view.ranks:
        generation = entry.engine_rank % 2
        assert entry.address == address(entry.engine_rank, generation)
        assert entry.registrations == 1 + generation


def churn(
    server: BootstrapServer, credential: ClusterCredential, layout: str, rank: int
) -> set[RankAddress]:
    seen: set[RankAddress] = set()
    with BootstrapClient(server.url, retries=2, credential=credential) as client:
        if rank % 2:
            register(client, rank, layout, generation=1)  # odd ranks restart
        for _ in range(3):
            seen.add(client.rank_address(rank % TP, rank // TP))
    return seen
