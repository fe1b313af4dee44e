"""Synthetic workloads and length specs: shapes, distributions, reproducibility, context checks."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest
from baton.services.loadtest.errors import BenchInputError
from baton.services.loadtest.lengths import LengthDistribution as L
from baton.services.loadtest.workloads.base import Session, Turn, WorkloadContext
from baton.services.loadtest.workloads.multi_turn import MultiTurnWorkload
from baton.services.loadtest.workloads.random import RandomWorkload, RequestClass
from baton.services.loadtest.workloads.shared_prefix import SharedPrefixWorkload, popularity_weights

VOCAB = 500


def prepared(workload, max_len=4096):
    asyncio.run(workload.prepare(WorkloadContext(VOCAB, max_len, None), 100))
    return workload


def test_length_specs():
    assert (L.parse("128").low, L.parse("128").high) == (128, 128)
    u = L.parse("uniform:10:20")
    rng = np.random.default_rng(0)
    draws = [u.sample(rng) for _ in range(2000)]
    assert min(draws) == 10 and max(draws) == 20
    n = L.parse("normal:100:10")
    assert (n.low, n.high) == (70, 130)
    draws = [n.sample(rng) for _ in range(4000)]
    assert np.mean(draws) == pytest.approx(100, abs=1.0) and np.std(draws) == pytest.approx(10, rel=0.1)
    assert all(70 <= d <= 130 for d in draws)
    assert L.parse("normal:5:10").low == 1  # clipped at 1
    for spec in ("uniform:10:20", "normal:100:10", "7"):
        assert L.parse(L.parse(spec).spec()) == L.parse(spec)


@pytest.mark.parametrize("spec", ["", "abc", "0", "uniform:5:1", "uniform:5", "normal:1:-1", "zipf:3:4", "uniform:a:b"])
def test_bad_length_specs(spec):
    with pytest.raises(BenchInputError, match="length"):
        L.parse(spec)


def test_random_classes_lengths_and_reproducibility():
    workload = prepared(
        RandomWorkload([RequestClass.parse("long,1,uniform:200:300,4"), RequestClass.parse("short,3,16,uniform:8:12")])
    )
    sessions = [workload.session(0, 0, i) for i in range(2000)]
    counts = Counter(s.group for s in sessions)
    assert counts["short"] / 2000 == pytest.approx(0.75, abs=0.03)
    for s in sessions:
        (turn,) = s.turns
        ids = turn.new_token_ids
        assert all(0 <= t < VOCAB for t in ids)
        if s.group == "long":
            assert 200 <= len(ids) <= 300 and turn.max_tokens == 4
        else:
            assert len(ids) == 16 and 8 <= turn.max_tokens <= 12
    again = workload.session(0, 0, 5)
    assert again.turns[0].new_token_ids == sessions[5].turns[0].new_token_ids
    assert workload.session(1, 0, 5).turns[0].new_token_ids != sessions[5].turns[0].new_token_ids  # other seed
    # the next run of a sweep: the same shapes, other tokens (nothing for the prefix cache to find)
    for i in range(50):
        a, b = sessions[i], workload.session(0, 1, i)
        assert (a.group, len(a.turns[0].new_token_ids), a.turns[0].max_tokens) == (
            b.group,
            len(b.turns[0].new_token_ids),
            b.turns[0].max_tokens,
        )
        assert a.turns[0].new_token_ids != b.turns[0].new_token_ids


@pytest.mark.parametrize("spec", ["a,1,10", "a,x,10,10", "a,0,10,10", "a,1,foo,10"])
def test_bad_request_classes(spec):
    with pytest.raises(BenchInputError):
        RequestClass.parse(spec)


def test_random_workload_must_fit_the_context():
    workload = RandomWorkload([RequestClass("r", 1, L.parse("uniform:100:200"), L.parse("60"))])
    with pytest.raises(BenchInputError, match="260 tokens.*context length 256"):
        prepared(workload, max_len=256)
    prepared(workload, max_len=260)


def test_shared_prefix_groups_share_exact_prefixes():
    workload = prepared(SharedPrefixWorkload(4, L.parse("64"), L.parse("uniform:4:8"), L.parse("3")))
    sessions = [workload.session(0, 0, i) for i in range(200)]
    by_group: dict[str, list[list[int]]] = {}
    for s in sessions:
        by_group.setdefault(s.group, []).append(s.turns[0].new_token_ids)
    assert sorted(by_group) == ["prefix-000", "prefix-001", "prefix-002", "prefix-003"]
    prefixes = {g: prompts[0][:64] for g, prompts in by_group.items()}
    assert len({tuple(p) for p in prefixes.values()}) == 4  # groups differ
    for g, prompts in by_group.items():
        assert all(p[:64] == prefixes[g] and 68 <= len(p) <= 72 for p in prompts)
    # the next run of a sweep: the same groups and lengths, fresh prefixes (the server has not cached them)
    for i in range(20):
        a, b = sessions[i], workload.session(0, 1, i)
        assert a.group == b.group and len(a.turns[0].new_token_ids) == len(b.turns[0].new_token_ids)
        assert b.turns[0].new_token_ids[:64] not in list(prefixes.values())


def test_zipf_popularity():
    weights = popularity_weights(4, "zipf")
    assert weights == pytest.approx(np.array([1, 1 / 2, 1 / 3, 1 / 4]) / (25 / 12))
    assert popularity_weights(3, "zipf:0") == pytest.approx([1 / 3] * 3)
    assert popularity_weights(2, "uniform") == [0.5, 0.5]
    workload = prepared(SharedPrefixWorkload(8, L.parse("16"), L.parse("4"), L.parse("2"), "zipf:1.2"))
    counts = Counter(workload.session(3, 0, i).group for i in range(4000))
    expected = popularity_weights(8, "zipf:1.2")
    for g in range(8):
        assert counts[f"prefix-{g:03d}"] / 4000 == pytest.approx(expected[g], abs=0.025)


@pytest.mark.parametrize("popularity", ["zipf:x", "pareto", "zipf:-1"])
def test_bad_popularity(popularity):
    with pytest.raises(BenchInputError, match="popularity"):
        SharedPrefixWorkload(4, L.parse("16"), L.parse("4"), L.parse("2"), popularity)


def test_multi_turn_sessions_and_context_bound():
    workload = MultiTurnWorkload(3, L.parse("40"), L.parse("uniform:5:10"), L.parse("8"), think_time_s=0.5)
    assert workload.needs_reply_token_ids
    assert workload.max_context_tokens() == 40 + 2 * 10 + 3 * 8
    prepared(workload, max_len=84)
    with pytest.raises(BenchInputError, match="multi-turn"):
        prepared(workload, max_len=83)
    session = workload.session(0, 0, 0)
    assert [t.group for t in session.turns] == ["turn-1", "turn-2", "turn-3"]
    assert len(session.turns[0].new_token_ids) == 40 and all(5 <= len(t.new_token_ids) <= 10 for t in session.turns[1:])
    assert session.think_time_s == 0.5
    other_run = workload.session(0, 1, 0)
    assert [len(t.new_token_ids) for t in other_run.turns] == [len(t.new_token_ids) for t in session.turns]
    assert other_run.turns[0].new_token_ids != session.turns[0].new_token_ids


def test_text_prompts_are_single_turn():
    with pytest.raises(ValueError):
        Session("x", [Turn(4, text="a"), Turn(4, text="b")])
