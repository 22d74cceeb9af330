"""Trace loaders, transforms and synthetic arrivals: exact parsing and every rejection path."""

from __future__ import annotations

import numpy as np
import pytest

from tspd_sim.errors import TraceError
from tspd_sim.traces import load_trace, parse_azure, parse_mooncake, synthetic
from tspd_sim.traces.synthetic import parse_length

MOONCAKE = (
    '{"timestamp": 2000, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]}\n'
    '{"timestamp": 500, "input_length": 600, "output_length": 3, "hash_ids": [0, 9]}\n'
    "\n"
    '{"timestamp": 500, "input_length": 10, "output_length": 1}\n'
)


def test_mooncake_parse_sorts_stably_and_rebases() -> None:
    t = parse_mooncake(MOONCAKE)
    assert t.arrival_s.tolist() == [0.0, 0.0, 1.5]
    assert t.input_len.tolist() == [600, 10, 1100]
    assert t.output_len.tolist() == [3, 1, 7]
    assert [t.hashes(i).tolist() for i in range(3)] == [[0, 9], [], [0, 1, 2]]
    assert t.block_tokens == 512
    assert t.has_prefixes


def test_bundled_mooncake_matches_published_shape() -> None:
    t = load_trace("mooncake")
    assert len(t) == 12031
    assert int(t.output_len.sum()) == 4122048
    assert int(t.input_len.max()) == 126195
    assert round(t.describe()["input_mean"]) == 12035
    # Every request names one id per 512-token block of its prompt.
    assert np.array_equal(np.diff(t.hash_offsets), -(-t.input_len // 512))
    assert t.arrival_s[0] == 0.0
    assert t.duration_s == pytest.approx(3536.999)


def test_bundled_azure_traces_load() -> None:
    code, conv = load_trace("azure-code"), load_trace("azure-conv")
    assert (len(code), len(conv)) == (8819, 19366)
    assert not code.has_prefixes
    assert round(code.describe()["input_mean"]) == 2048
    assert code.input_len[:4].tolist() == [4808, 3180, 110, 7433]
    assert code.arrival_s[1] == pytest.approx(0.052)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "line 1: not JSON"),
        ("[1, 2]", "expected an object"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1}', "integer ≥ 1"),
        ('{"timestamp": 0, "input_length": 5.5, "output_length": 1}', "integer ≥ 1"),
        ('{"timestamp": "x", "input_length": 5, "output_length": 1}', "'timestamp' must be"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}', "hash_ids"),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, 2]}',
            "2 hash ids",
        ),
        ("", "no requests"),
    ],
)
def test_mooncake_rejections(line: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        parse_mooncake(line)


def test_azure_rejections() -> None:
    with pytest.raises(TraceError, match="missing column"):
        parse_azure("a,b\n1,2\n")
    with pytest.raises(TraceError, match="GeneratedTokens must be an integer"):
        parse_azure("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,5,0\n")
    with pytest.raises(TraceError, match="bad TIMESTAMP"):
        parse_azure("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,1\n")
    with pytest.raises(TraceError, match="neither a bundled trace"):
        load_trace("no-such-trace")


def test_transforms_keep_hash_rows_aligned() -> None:
    t = parse_mooncake(MOONCAKE)
    assert t.scale_rate(2.0).arrival_s.tolist() == [0.0, 0.0, 0.75]
    assert t.scale_time(2.0).arrival_s.tolist() == [0.0, 0.0, 3.0]
    tail = t.select(np.array([2, 0]))
    assert [tail.hashes(i).tolist() for i in range(2)] == [[0, 9], [0, 1, 2]]
    w = t.window(1.0, 2.0)
    assert (len(w), w.arrival_s.tolist(), w.hashes(0).tolist()) == (1, [0.5], [0, 1, 2])
    c = t.clip_lengths(max_input=513, max_output=2)
    assert c.input_len.tolist() == [513, 10, 513]
    assert c.output_len.tolist() == [2, 1, 2]
    assert [c.hashes(i).tolist() for i in range(3)] == [[0, 9], [], [0, 1]]
    with pytest.raises(TraceError, match="positive"):
        t.scale_rate(0)
    with pytest.raises(TraceError, match="after the start"):
        t.window(2.0, 1.0)


def test_synthetic_is_seeded_and_has_the_requested_rate() -> None:
    a = synthetic(20000, 8.0, "fixed:100", "uniform:1:9", seed=3)
    b = synthetic(20000, 8.0, "fixed:100", "uniform:1:9", seed=3)
    assert np.array_equal(a.arrival_s, b.arrival_s)
    assert np.array_equal(a.output_len, b.output_len)
    assert not np.array_equal(a.arrival_s, synthetic(20000, 8.0, seed=4).arrival_s)
    assert a.rate == pytest.approx(8.0, rel=0.03)
    assert set(np.unique(a.input_len).tolist()) == {100}
    assert set(np.unique(a.output_len).tolist()) == set(range(1, 10))


def test_gamma_burstiness_changes_the_gap_cv() -> None:
    for cv in (0.5, 1.0, 3.0):
        gaps = np.diff(synthetic(40000, 4.0, cv=cv, seed=1).arrival_s)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.06)
        assert 1 / gaps.mean() == pytest.approx(4.0, rel=0.05)


def test_length_specs() -> None:
    rng = np.random.Generator(np.random.PCG64(0))
    logn = parse_length("lognormal:1000:0.5").sample(rng, 50000, "input")
    assert logn.mean() == pytest.approx(1000, rel=0.02)
    from_trace = parse_length("trace:azure-code").sample(rng, 10, "output")
    assert set(from_trace.tolist()) <= set(load_trace("azure-code").output_len.tolist())
    for bad in ("fixed:0", "uniform:5:1", "lognormal:x:1", "zipf:1", "trace:"):
        with pytest.raises(TraceError, match="bad length distribution"):
            parse_length(bad)
    with pytest.raises(TraceError, match="rate must be"):
        synthetic(5, 0.0)
