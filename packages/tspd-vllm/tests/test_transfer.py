"""The connector's worker sides moving vLLM's own KV tensors (allocated by vLLM's
``allocate_kv_cache``) with real tspd peers: Mooncake over TCP, transfer worker processes,
the bootstrap server, the layout planner — equal TP, a pair that does not divide (P TP 2 →
D TP 3: vLLM's MooncakeConnector refuses it), both page orders and block-outermost layouts.
Exact bytes: every prompt token's K/V of every layer and head on D equals P's, and no other
block of D's changed."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from tspd_bootstrap import BootstrapServer
from tspd_core.layout import ContractMismatch, RouteError
from tspd_vllm.arena import build_arena
from tspd_vllm.jobs import JobBatch, RecvJob, SendJob
from tspd_vllm.params import Rendezvous
from tspd_vllm.settings import Role, Settings
from tspd_vllm.worker import DecodeSide, PrefillSide, Rank, Results

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

LAYERS, HEADS, HEAD, BLOCK, BLOCKS = 3, 6, 64, 32, 12
KvFactory = Callable[..., dict[str, torch.Tensor]]


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    with BootstrapServer("127.0.0.1", 0) as srv:
        yield srv


def _settings(role: Role, server: BootstrapServer) -> Settings:
    return Settings(
        role=role,
        bootstrap_host="127.0.0.1",
        bootstrap_port=server.port,
        serve_bootstrap=False,
        host="127.0.0.1",
    )


@dataclass
class Node:
    """One instance: its ranks' KV views and worker sides."""

    caches: list[dict[str, torch.Tensor]]
    sides: list[PrefillSide] | list[DecodeSide]

    def close(self) -> None:
        for side in self.sides:
            side.close()


def _node(
    role: Role,
    tp: int,
    server: BootstrapServer,
    make: KvFactory,
    layout: KVCacheLayout,
    fill: bool,
) -> Node:
    caches, sides = [], []
    local = HEADS // tp
    for r in range(tp):
        kv = make(
            layers=LAYERS,
            kv_heads=local,
            head_size=HEAD,
            block_size=BLOCK,
            num_blocks=BLOCKS,
            layout=layout,
        )
        if fill:  # every element a function of (layer, block, global head, token, column)
            for layer, view in enumerate(kv.values()):
                b, h, n, c = torch.meshgrid(*(torch.arange(s) for s in view.shape), indexing="ij")
                gh = h + r * local
                value = (layer * 7 + b * 13 + gh * 31 + n * 3 + c) % 251
                view.copy_(value.to(view.dtype))
        arena = build_arena(kv, total_kv_heads=HEADS)
        side_cls = PrefillSide if role == Role.PREFILL else DecodeSide
        sides.append(side_cls(_settings(role, server), arena, Rank(size=tp, rank=r)))
        caches.append(kv)
    return Node(caches, sides)


def _drive(p: Node, d: Node, p_rid: str, d_rid: str, timeout_s: float = 60.0) -> None:
    """Poll every rank until P's send and D's receive both ended (D must not fail)."""
    sent: set[int] = set()
    got: dict[int, Results] = {}
    deadline = time.monotonic() + timeout_s
    while len(sent) < len(p.sides) or len(got) < len(d.sides):
        assert time.monotonic() < deadline, f"no end within {timeout_s} s: {sent} {got}"
        for r, side in enumerate(p.sides):
            if p_rid in side.results((), idle=True).sending:
                sent.add(r)
        for r, dside in enumerate(d.sides):
            news = dside.results((), idle=True)
            if d_rid in news.recving:
                got[r] = news
    assert all(not news.failed for news in got.values()), got


def _global(node: Node, layer: int, block: int, tokens: int) -> torch.Tensor:
    """One layer's block as (global heads, tokens, content) across the instance's ranks."""
    parts = []
    for kv in node.caches:
        view = list(kv.values())[layer][block]  # (heads, tokens, content), any page order
        parts.append(view[:, :tokens])
    return torch.cat(parts, dim=0)


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "layout"),
    [
        (1, 1, KVCacheLayout.LBHNC),  # vLLM's CPU backend: heads outermost in a page
        (2, 3, KVCacheLayout.LBHNC),  # a pair that does not divide
        (3, 1, KVCacheLayout.LBNHC),  # tokens outermost (NHD)
        (1, 2, KVCacheLayout.BLHNC),  # block-outermost: every layer's page in one block
    ],
)
def test_prompt_kv_arrives_exactly(
    p_tp: int, d_tp: int, layout: KVCacheLayout, server: BootstrapServer, make_kv_caches: KvFactory
) -> None:
    p = _node(Role.PREFILL, p_tp, server, make_kv_caches, layout, fill=True)
    d = _node(Role.DECODE, d_tp, server, make_kv_caches, layout, fill=False)
    try:
        prompt_len = 2 * BLOCK + 9  # two whole blocks and a partial one
        p_blocks, d_blocks = (3, 7, 5), (2, 10, 4)
        meet = Rendezvous("127.0.0.1", server.port, 4242)
        send = SendJob("p-req", meet, p_blocks, prompt_len, first_token=17)
        recv = RecvJob("d-req", meet, d_blocks, prefix_len=0, prompt_len=prompt_len)
        for side in p.sides:
            side.take(JobBatch(sends=(send,)))
        for dside in d.sides:
            dside.take(JobBatch(recvs=(recv,)))
        _drive(p, d, "p-req", "d-req")
        for layer in range(LAYERS):
            for slot, (pb, db) in enumerate(zip(p_blocks, d_blocks, strict=True)):
                tokens = min(BLOCK, prompt_len - slot * BLOCK)
                want = _global(p, layer, pb, tokens)
                assert torch.equal(_global(d, layer, db, tokens), want), (layer, slot)
        untouched = [b for b in range(BLOCKS) if b not in d_blocks]
        for kv in d.caches:
            for view in kv.values():
                assert not view[untouched].any()
    finally:
        d.close()
        p.close()


def test_page_orders_that_differ_fail_the_receive(
    server: BootstrapServer, make_kv_caches: KvFactory
) -> None:
    """P in HND and D in NHD: D's receive fails (no bytes land), P's send ends, both say why."""
    p = _node(Role.PREFILL, 1, server, make_kv_caches, KVCacheLayout.LBHNC, fill=True)
    d = _node(Role.DECODE, 1, server, make_kv_caches, KVCacheLayout.LBNHC, fill=False)
    try:
        meet = Rendezvous("127.0.0.1", server.port, 77)
        p.sides[0].take(JobBatch(sends=(SendJob("p", meet, (1, 2), 40, 5),)))
        d.sides[0].take(JobBatch(recvs=(RecvJob("d", meet, (3, 4), 0, 40),)))
        deadline = time.monotonic() + 60
        news = Results()
        while "d" not in news.recving:
            assert time.monotonic() < deadline
            news = d.sides[0].results((), idle=True)
            p.sides[0].results((), idle=True)
        assert news.failed == {"d"}
        for view in d.caches[0].values():
            assert not view.any()
    finally:
        d.close()
        p.close()


def test_contracts_of_vllm_tensors_plan_like_tspd_ones(make_kv_caches: KvFactory) -> None:
    """The planner's own checks on the arenas: page orders that differ are a ContractMismatch
    naming the field and both partitions; a rank of 3 heads (of 6) cannot be one of TP 3."""
    from tspd_core.layout import plan_routes

    hnd = build_arena(make_kv_caches(layers=2, kv_heads=3, head_size=HEAD, block_size=BLOCK,
                                     num_blocks=4), total_kv_heads=HEADS)  # fmt: skip
    nhd = build_arena(make_kv_caches(layers=2, kv_heads=3, head_size=HEAD, block_size=BLOCK,
                                     num_blocks=4, layout=KVCacheLayout.LBNHC),
                      total_kv_heads=HEADS)  # fmt: skip
    with pytest.raises(ContractMismatch, match=r"layer.0.kv partition: axis 0 .* vs axis 1"):
        plan_routes(hnd.contract, 2, nhd.contract, 2)
    with pytest.raises(RouteError):
        plan_routes(hnd.contract, 2, hnd.contract, 3)


def test_request_finished_while_receiving_is_aborted_and_reported_once(
    server: BootstrapServer, make_kv_caches: KvFactory
) -> None:
    """vLLM finished D's request (a client abort) before P sent anything: tspd aborts the room
    and the receive is reported finished once (vLLM frees the blocks then), never failed, and
    no byte landed. (P learns nothing from D here — TokenSpeed's wire has no D → P abort —
    so the PD front gives a room no D pulled up on P: the next test.)"""
    p = _node(Role.PREFILL, 1, server, make_kv_caches, KVCacheLayout.LBHNC, fill=True)
    d = _node(Role.DECODE, 1, server, make_kv_caches, KVCacheLayout.LBHNC, fill=False)
    try:
        meet = Rendezvous("127.0.0.1", server.port, 91)
        d.sides[0].take(JobBatch(recvs=(RecvJob("d", meet, (3, 4), 0, 40),)))
        first = d.sides[0].results({"d"}, idle=True)  # vLLM finished it this step
        deadline = time.monotonic() + 60
        news = [first]
        while not any("d" in n.recving for n in news):
            assert time.monotonic() < deadline
            news.append(d.sides[0].results((), idle=True))
        assert [n.failed for n in news] == [set()] * len(news)
        assert sum("d" in n.recving for n in news) == 1
        for view in d.caches[0].values():
            assert not view.any()
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("when", ["later", "same step", "before the send"])
def test_a_room_given_up_ends_p_s_send_at_once(
    when: str, server: BootstrapServer, make_kv_caches: KvFactory
) -> None:
    """P holds a prefilled room no D will pull (the front's ``abort_room``): the send ends
    within seconds — vLLM frees its blocks then — instead of at P's 120 s bootstrap timeout;
    whether the abort comes in a later step, with the send, or before it."""
    p = _node(Role.PREFILL, 1, server, make_kv_caches, KVCacheLayout.LBHNC, fill=True)
    try:
        send = SendJob("p", Rendezvous("127.0.0.1", server.port, 93), (1, 2), 40, 5)
        side = p.sides[0]
        if when == "later":
            side.take(JobBatch(sends=(send,)))
            assert side.results((), idle=True).sending == set()  # held: no D came
            side.take(JobBatch(room_aborts=(93,)))
        elif when == "same step":
            side.take(JobBatch(sends=(send,), room_aborts=(93,)))
        else:
            side.take(JobBatch(room_aborts=(93,)))
            side.take(JobBatch(sends=(send,)))
        deadline = time.monotonic() + 10  # P's bootstrap timeout is 120 s
        ended: list[set[str]] = []
        while not any("p" in e for e in ended):
            assert time.monotonic() < deadline, "the send did not end"
            ended.append(side.results((), idle=True).sending)
        assert sum("p" in e for e in ended) == 1
    finally:
        p.close()


LATENT = 576  #: DeepSeek-V2's latent: kv_lora_rank 512 + rope 64 (vLLM's CPU MLA width)


def _mla_node(role: Role, tp: int, server: BootstrapServer, make: KvFactory, fill: bool) -> Node:
    """An MLA instance: every rank holds the whole latent (the same bytes on each)."""
    caches, sides = [], []
    for r in range(tp):
        kv = make(layers=LAYERS, kv_heads=1, head_size=LATENT, block_size=16, num_blocks=BLOCKS,
                  mla=True)  # fmt: skip
        if fill:
            for layer, view in enumerate(kv.values()):
                b, _, n, c = torch.meshgrid(*(torch.arange(s) for s in view.shape), indexing="ij")
                view.copy_(((layer * 7 + b * 13 + n * 3 + c) % 251).to(view.dtype))
        arena = build_arena(kv, total_kv_heads=1, replicated=True)
        side_cls = PrefillSide if role == Role.PREFILL else DecodeSide
        sides.append(side_cls(_settings(role, server), arena, Rank(size=tp, rank=r)))
        caches.append(kv)
    return Node(caches, sides)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)])
def test_mla_latent_arrives_exactly(
    p_tp: int, d_tp: int, server: BootstrapServer, make_kv_caches: KvFactory
) -> None:
    """vLLM's MLA KV views (``MLAAttentionSpec``: ``[blocks, 1, 16, 576]`` per layer) as a
    replicated field: every D rank gets every prompt token's latent of every layer, equal TP
    or not, and nothing else of D changes."""
    p = _mla_node(Role.PREFILL, p_tp, server, make_kv_caches, fill=True)
    d = _mla_node(Role.DECODE, d_tp, server, make_kv_caches, fill=False)
    try:
        prompt_len = 2 * 16 + 5
        p_blocks, d_blocks = (3, 7, 5), (2, 10, 4)
        meet = Rendezvous("127.0.0.1", server.port, 4343)
        send = SendJob("p-req", meet, p_blocks, prompt_len, first_token=17)
        recv = RecvJob("d-req", meet, d_blocks, prefix_len=0, prompt_len=prompt_len)
        for side in p.sides:
            side.take(JobBatch(sends=(send,)))
        for dside in d.sides:
            dside.take(JobBatch(recvs=(recv,)))
        _drive(p, d, "p-req", "d-req")
        want = list(p.caches[0].values())
        untouched = [b for b in range(BLOCKS) if b not in d_blocks]
        for kv in d.caches:
            for view, p_view in zip(kv.values(), want, strict=True):
                for slot, (pb, db) in enumerate(zip(p_blocks, d_blocks, strict=True)):
                    tokens = min(16, prompt_len - slot * 16)
                    assert torch.equal(view[db, :, :tokens], p_view[pb, :, :tokens]), slot
                assert not view[untouched].any()
    finally:
        d.close()
        p.close()
