"""ShareGPT files: parsing, clear errors for malformed files, token-length preparation."""

from __future__ import annotations

import asyncio
import json

import pytest
from baton.services.loadtest.errors import BenchInputError
from baton.services.loadtest.workloads.base import WorkloadContext
from baton.services.loadtest.workloads.sharegpt import ShareGPTWorkload, parse_sharegpt


def conversation(prompt: str, reply: str, first: str = "human") -> dict:
    return {"id": prompt[:8], "conversations": [{"from": first, "value": prompt}, {"from": "gpt", "value": reply}]}


def write(tmp_path, data, name="data.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


async def count_words(texts, add_special_tokens):
    """A stand-in tokenizer: one token per word, plus one for BOS on prompts."""
    return [len(t.split()) + (1 if add_special_tokens else 0) for t in texts]


def test_parses_first_exchange_and_skips_unusable(tmp_path):
    data = [
        conversation("hello there", "general kenobi"),
        {"conversations": [{"from": "system", "value": "be nice"}, *conversation("q two", "a two")["conversations"]]},
        {"conversations": [{"from": "human", "value": "no reply"}]},  # skipped: nothing to size the output
        {"conversations": []},  # skipped
        conversation("   ", "blank prompt"),  # skipped
        {"conversations": [{"from": "user", "value": "openai-style role"}, {"from": "assistant", "value": "ok"}]},
    ]
    exchanges = parse_sharegpt(write(tmp_path, data))
    assert [(e.prompt, e.reply) for e in exchanges] == [
        ("hello there", "general kenobi"),
        ("q two", "a two"),
        ("openai-style role", "ok"),
    ]


@pytest.mark.parametrize(
    "content, message",
    [
        ('[{"conversations": [', "is not valid JSON: .* at line 1 column"),
        ('{"conversations": []}', "expected a JSON list of conversations, got dict"),
        ('[{"id": 1}]', 'entry 0 has no "conversations" list'),
        ('[["human", "hi"]]', 'entry 0 has no "conversations" list'),
        (
            '[{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt"}]}]',
            "entry 0, turn 1 must be an object",
        ),
        ('[{"conversations": [{"from": "human", "value": 3}]}]', "entry 0, turn 0"),
        ('[{"conversations": [{"from": "human", "value": "only a prompt"}]}]', "no conversation with a human prompt"),
        ("[]", "no conversation with a human prompt"),
    ],
)
def test_malformed_files_are_named_errors(tmp_path, content, message):
    path = write(tmp_path, content)
    with pytest.raises(BenchInputError, match=message) as error:
        ShareGPTWorkload(path)
    assert str(path) in str(error.value)


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(BenchInputError, match="cannot read the dataset"):
        ShareGPTWorkload(tmp_path / "nope.json")
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(BenchInputError, match="not UTF-8"):
        ShareGPTWorkload(binary)


def test_output_lengths_from_replies_and_context_filter(tmp_path):
    data = [conversation(" ".join(["w"] * n), " ".join(["r"] * (n // 2 + 1))) for n in (3, 10, 40, 80)]
    workload = ShareGPTWorkload(write(tmp_path, data))
    # a context of 64 tokens keeps prompts of 3, 10 and 40 words (+1 BOS, + the reply's words)
    asyncio.run(workload.prepare(WorkloadContext(0, 64, count_words), 10))
    turns = {workload.session(0, 0, i).turns[0].num_text_tokens: workload.session(0, 0, i).turns[0] for i in range(3)}
    assert sorted(turns) == [4, 11, 41]
    assert [turns[n].max_tokens for n in (4, 11, 41)] == [2, 6, 21]
    assert all(not workload.session(0, 0, i).turns[0].text.startswith("w " * 80) for i in range(10))


def test_needs_a_tokenizer_or_a_fixed_output_length(tmp_path):
    path = write(tmp_path, [conversation("a b c", "d e")])
    with pytest.raises(BenchInputError, match="no tokenizer"):
        asyncio.run(ShareGPTWorkload(path).prepare(WorkloadContext(0, 64, None), 1))
    fixed = ShareGPTWorkload(path, output_len=7)
    asyncio.run(fixed.prepare(WorkloadContext(0, None, None), 1))
    turn = fixed.session(0, 0, 0).turns[0]
    assert (turn.text, turn.max_tokens, turn.num_text_tokens) == ("a b c", 7, None)


def test_nothing_fits(tmp_path):
    workload = ShareGPTWorkload(write(tmp_path, [conversation("a " * 50, "b")]))
    with pytest.raises(BenchInputError, match="no conversation .* fits"):
        asyncio.run(workload.prepare(WorkloadContext(0, 16, count_words), 1))


def test_runs_of_a_sweep_take_their_own_conversations(tmp_path):
    data = [conversation(f"prompt number {i}", "reply") for i in range(20)]
    workload = ShareGPTWorkload(write(tmp_path, data))
    asyncio.run(workload.prepare(WorkloadContext(0, None, count_words, seed=1, num_runs=2), 10))
    run0 = {workload.session(1, 0, i).turns[0].text for i in range(10)}
    run1 = {workload.session(1, 1, i).turns[0].text for i in range(10)}
    assert len(run0) == len(run1) == 10 and not run0 & run1
    assert workload.session(1, 0, 3).turns[0].text == workload.session(1, 0, 3).turns[0].text
