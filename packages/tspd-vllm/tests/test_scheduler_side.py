"""The scheduler side's rules and the client input it parses: exact jobs, answers and refusals
(no vLLM process: these are the rules the connector applies to vLLM's hooks)."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from tspd_core.ids import MAX_ROOM
from tspd_vllm.connector import check_kv_cache
from tspd_vllm.errors import SettingsError, TransferParamsError, UnsupportedModelError
from tspd_vllm.jobs import JobBatch, RecvJob, SendJob
from tspd_vllm.params import Rendezvous, remote_prefill, room_for, wants_remote_decode
from tspd_vllm.scheduler import DecodeScheduler, PrefillScheduler
from tspd_vllm.settings import Role, Settings

pytestmark = pytest.mark.vllm

P = Settings(role=Role.PREFILL, bootstrap_host="10.1.2.3", bootstrap_port=8998)
MEET = Rendezvous("10.1.2.3", 8998, 7)


def test_prefill_holds_blocks_and_answers_the_rendezvous() -> None:
    sched = PrefillScheduler(P)
    hold, answer = sched.finished(
        "r1",
        {"do_remote_decode": True, "bootstrap_room": 7},
        prefilled=True,
        block_ids=[4, 9],
        prompt_len=40,
        first_token=11,
    )
    assert hold is True
    assert answer == {"do_remote_prefill": True, "do_remote_decode": False,
                      "bootstrap_host": "10.1.2.3", "bootstrap_port": 8998,
                      "bootstrap_room": 7, "kv_tokens": 40}  # fmt: skip
    assert sched.pending()
    meet = Rendezvous("10.1.2.3", 8998, 7, 40)
    assert sched.take().sends == (SendJob("r1", meet, (4, 9), 40, 11),)
    assert sched.take().sends == ()
    sched.reported({"r1"})
    assert not sched.pending()


@pytest.mark.parametrize(
    ("params", "prefilled", "blocks"),
    [
        (None, True, [1]),  # a colocated request
        ({"do_remote_decode": False}, True, [1]),
        ({"do_remote_decode": True}, False, [1]),  # aborted: nothing to send
        ({"do_remote_decode": True}, True, []),
        ({"do_remote_decode": "yes"}, True, [1]),  # malformed: no hand-over
        ({"do_remote_decode": True, "bootstrap_room": -1}, True, [1]),
    ],
)
def test_prefill_sends_nothing_otherwise(
    params: object, prefilled: bool, blocks: list[int]
) -> None:
    sched = PrefillScheduler(P)
    got = sched.finished("r", params, prefilled=prefilled, block_ids=blocks, prompt_len=5,
                         first_token=1)  # fmt: skip
    assert got == (False, None)
    assert sched.take().sends == ()
    assert not sched.pending()


def test_prefill_fails_a_room_the_front_gives_up_once() -> None:
    """A request naming ``abort_room`` puts that room in the step's batch, once however often
    vLLM asks about the request; malformed ones abort nothing."""
    sched = PrefillScheduler(P)
    sched.scheduling("a", {"abort_room": 7})
    sched.scheduling("a", {"abort_room": 7})  # vLLM asks again (not scheduled yet)
    for rid, params in [("b", None), ("c", {"abort_room": -1}), ("d", {"abort_room": True}),
                        ("e", {"abort_room": MAX_ROOM + 1}), ("f", ["abort_room"])]:  # fmt: skip
        sched.scheduling(rid, params)
    assert sched.take() == JobBatch(room_aborts=(7,))
    assert sched.take() == JobBatch()
    got = sched.finished("a", {"abort_room": 7}, prefilled=True, block_ids=[3], prompt_len=1,
                         first_token=0)  # fmt: skip
    assert got == (False, None)
    assert not sched.pending()
    sched.scheduling("a", {"abort_room": 7})  # a later request of the same id: its own
    assert sched.take() == JobBatch(room_aborts=(7,))


def test_decode_loads_past_its_prefix_hit_once() -> None:
    sched = DecodeScheduler()
    params: dict[str, object] = dict(MEET.as_params())
    assert sched.matched("r", params, prompt_len=100, computed=32) == (68, True)
    assert sched.matched("r", params, prompt_len=100, computed=32) == (68, True)  # no effect
    sched.allocated("r", params, [5, 6, 7, 8], external=68, prompt_len=100)
    assert sched.take().recvs == (RecvJob("r", MEET, (5, 6, 7, 8), 32, 100),)
    assert params["do_remote_prefill"] is False
    assert sched.matched("r", MEET.as_params(), prompt_len=100, computed=0) == (0, False)
    sched.finished("r")
    assert "r" not in sched.started


def test_decode_loads_p_s_prompt_and_computes_what_follows() -> None:
    """D's prompt is P's plus P's first token: the KV of P's 100 tokens is loaded (past D's
    hit of 32), the 101st computed on D."""
    sched = DecodeScheduler()
    meet = Rendezvous("10.1.2.3", 8998, 7, 100)
    params: dict[str, object] = dict(meet.as_params())
    assert sched.matched("r", params, prompt_len=101, computed=32) == (68, True)
    sched.allocated("r", params, [5, 6, 7, 8], external=68, prompt_len=101)
    assert sched.take().recvs == (RecvJob("r", meet, (5, 6, 7, 8), 32, 100),)
    assert DecodeScheduler().matched("r", meet.as_params(), prompt_len=90, computed=0) == (
        90,
        True,
    )  # a kv_tokens past D's prompt: D's prompt


@pytest.mark.parametrize(
    "params",
    [
        None,
        {"do_remote_prefill": False},
        {"do_remote_prefill": True, "bootstrap_host": "h", "bootstrap_port": 0,
         "bootstrap_room": 1},
        {"do_remote_prefill": True, "bootstrap_host": "", "bootstrap_port": 1,
         "bootstrap_room": 1},
        {"do_remote_prefill": True, "bootstrap_host": "h/x", "bootstrap_port": 1,
         "bootstrap_room": 1},
        {"do_remote_prefill": True, "bootstrap_host": "h", "bootstrap_port": 1,
         "bootstrap_room": MAX_ROOM + 1},
        {"do_remote_prefill": True, "bootstrap_host": "h", "bootstrap_port": True,
         "bootstrap_room": 1},
        ["do_remote_prefill"],
    ],
)  # fmt: skip
def test_decode_computes_locally_on_bad_or_no_params(params: object) -> None:
    assert DecodeScheduler().matched("r", params, prompt_len=10, computed=0) == (0, False)


def test_params_refusals_name_the_key() -> None:
    with pytest.raises(TransferParamsError, match="bootstrap_port"):
        remote_prefill({"do_remote_prefill": True, "bootstrap_host": "h", "bootstrap_port": "1",
                        "bootstrap_room": 1})  # fmt: skip
    with pytest.raises(TransferParamsError, match="do_remote_decode"):
        wants_remote_decode({"do_remote_decode": 1})
    with pytest.raises(TransferParamsError, match="must be an object"):
        wants_remote_decode("x")
    assert room_for({"bootstrap_room": MAX_ROOM}) == MAX_ROOM
    assert 0 <= room_for(None) <= MAX_ROOM


def test_settings() -> None:
    s = Settings.from_config("kv_producer", {"bootstrap_port": 9000, "serve_bootstrap": False})
    assert (s.role, s.bootstrap_url, s.serve_bootstrap) == (Role.PREFILL, "127.0.0.1:9000", False)
    assert Settings.from_config("kv_consumer", None).role == Role.DECODE
    with pytest.raises(SettingsError, match="bootstrap_port"):
        Settings.from_config("kv_producer", {})
    with pytest.raises(SettingsError, match="kv_both"):
        Settings.from_config("kv_both", {})
    with pytest.raises(SettingsError, match=r"unknown keys \['bootstrap_prot'\]"):
        Settings.from_config("kv_consumer", {"bootstrap_prot": 1})


def _kv_config(*specs: KVCacheSpec) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_kv_caches_it_cannot_move_whole_are_refused_at_start_up() -> None:
    """One group of full attention or MLA is moved; several groups (a hybrid model), a
    sliding window or no attention at all are refused as the connector is built, by name."""
    bf16 = torch.bfloat16
    full = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=bf16)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=bf16)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=bf16,
                               sliding_window=128)  # fmt: skip
    check_kv_cache(_kv_config(full))
    check_kv_cache(_kv_config(mla))
    check_kv_cache(None)  # vLLM built no KV cache config for this role
    refused = [
        ((full, window), r"2 group\(s\): \['FullAttentionSpec', 'SlidingWindowSpec'\]"),
        ((full, full), r"2 group\(s\): \['FullAttentionSpec', 'FullAttentionSpec'\]"),
        ((window,), r"1 group\(s\): \['SlidingWindowSpec'\]"),
        ((), r"0 group\(s\): \[\]"),
    ]
    for specs, match in refused:
        with pytest.raises(UnsupportedModelError, match=match):
            check_kv_cache(_kv_config(*specs))
