"""OpenAI fields against a running Baton, with the unmodified `openai` client: logit_bias,
echo, prompt_logprobs, best_of, chat roles, logprob bytes, seed and user. Expected values
come from the offline engine on the same model (prompt logprobs are checked against
transformers in tests/services/engine/test_prompt_logprobs.py)."""

from __future__ import annotations

import httpx
import openai
import pytest
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.api.tokenizer import load_tokenizer
from testlib.models import tiny_model

pytestmark = pytest.mark.ray
MODEL = "baton-tiny"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(baton_app):
    return openai.OpenAI(base_url=f"{baton_app.http_address}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline():
    return LLM(model=str(tiny_model("llama")), num_kv_blocks=128, max_model_len=256)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(tiny_model("llama"))


def refused(baton_app, path: str, body: dict, param: str) -> str:
    reply = httpx.post(f"{baton_app.http_address}/v1/{path}", json={"model": MODEL, **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def byte_token(tokenizer, byte: int) -> int:
    """The vocabulary entry of one byte that is not a whole UTF-8 character (GPT-2 table)."""
    from baton.services.gateway.token_bytes import TokenBytes

    token_bytes = TokenBytes(tokenizer)
    return next(t for t in range(len(tokenizer)) if token_bytes(t) == [byte])


def test_logit_bias_forces_a_token_in_completions_and_chat(client, tokenizer):
    token = tokenizer.encode(" z", add_special_tokens=False)[0]
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logit_bias={str(token): 100},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert response.choices[0].model_extra["token_ids"] == [token] * 6
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=1.0,
        logit_bias={str(token): 100},
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content == " z" * 4


@pytest.mark.parametrize(
    ("bias", "words"),
    [({"abc": 1}, "'abc'"), ({"999999": 1}, "[999999]"), ({"5": -101}, "[-100, 100]")],
)
def test_bad_logit_bias_is_400_naming_it(baton_app, bias, words):
    message = refused(baton_app, "completions", {"prompt": PROMPT, "logit_bias": bias}, "logit_bias")
    assert words in message


def test_echo_puts_the_prompt_first(client, offline):
    (expected,) = offline.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].text == PROMPT + expected.text
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, stream=True, extra_body={"ignore_eos": True}
    )
    texts = [c.choices[0].text for c in stream if c.choices]
    assert texts[0].startswith(PROMPT) and "".join(texts) == PROMPT + expected.text


def test_echo_with_logprobs_scores_the_prompt_tokens(client, offline, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    (expected,) = offline.generate(
        [PROMPT], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    )
    for stream in (False, True):
        response = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=3,
            temperature=0,
            echo=True,
            logprobs=2,
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        if stream:
            chunks = [c for c in response if c.choices]
            logprobs = chunks[0].choices[0].logprobs
            assert chunks[0].choices[0].text.startswith(PROMPT)
            tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
            token_logprobs = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
        else:
            logprobs = response.choices[0].logprobs
            tokens, token_logprobs = logprobs.tokens, logprobs.token_logprobs
        assert len(tokens) == len(prompt_ids) + 3
        assert token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        want = [e[t].logprob for e, t in zip(expected.prompt_logprobs[1:], prompt_ids[1:])]
        assert token_logprobs[1 : len(prompt_ids)] == pytest.approx(want, abs=1e-4)
        assert token_logprobs[len(prompt_ids) :] == pytest.approx(
            [e[t].logprob for e, t in zip(expected.logprobs, expected.token_ids)], abs=1e-4
        )
        assert all(len(top) >= 2 for top in logprobs.top_logprobs[1 : len(prompt_ids)])


def test_prompt_logprobs_extension(client, offline, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    entries = response.choices[0].model_extra["prompt_logprobs"]
    assert response.choices[0].text and not response.choices[0].text.startswith(PROMPT)
    assert entries[0] is None and len(entries) == len(prompt_ids)
    (expected,) = offline.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    for got, want, token_id in zip(entries[1:], expected.prompt_logprobs[1:], prompt_ids[1:]):
        assert list(got) == [str(token_id)]
        assert got[str(token_id)]["logprob"] == pytest.approx(want[token_id].logprob, abs=1e-4)
        assert got[str(token_id)]["rank"] == want[token_id].rank


def test_best_of_returns_the_n_best_samples(client, baton_app, offline):
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True, logprobs=0)
    (everyone,) = offline.generate([PROMPT], params)
    best = sorted(everyone.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        n=2,
        best_of=4,
        max_tokens=8,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in response.choices] == [c.text for c in best]
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.completion_tokens == 2 * 8  # the returned samples' tokens, as vLLM counts
    body = {"prompt": PROMPT, "n": 1, "best_of": 2, "stream": True}
    assert "stream" in refused(baton_app, "completions", body, "best_of")
    assert "n" in refused(baton_app, "completions", {"prompt": PROMPT, "n": 3, "best_of": 2}, "best_of")


def test_chat_roles(client, baton_app, offline, tokenizer):
    def greedy_chat(messages):
        return (
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .message.content
        )

    as_system = greedy_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    as_developer = greedy_chat([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert as_developer == as_system  # the template knows no developer role: it is the system one
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "user", "content": "and?"},
    ]
    assert greedy_chat(history) is not None
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]}
    assert "'robot'" in refused(baton_app, "chat/completions", body, "messages[1].role")


def test_chat_logprob_bytes_are_the_tokens_own(client, tokenizer):
    """A token holding one byte of a multi-byte character: its bytes, never U+FFFD's."""
    token = byte_token(tokenizer, 0xE2)
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logit_bias={str(token): 100},
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = response.choices[0].logprobs.content
    assert [entry.bytes for entry in content] == [[0xE2]] * 3
    # The alternatives are the raw (unbiased) top tokens: whole characters keep their UTF-8.
    tops = [top for entry in content for top in entry.top_logprobs]
    assert all(top.bytes == list(top.token.encode()) for top in tops if "\ufffd" not in top.token)
    word = tokenizer.encode(" the", add_special_tokens=False)[0]
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        temperature=0,
        logit_bias={str(word): 100},
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    assert response.choices[0].logprobs.content[0].bytes == list(tokenizer.decode([word]).encode())


def test_seed_makes_sampling_reproducible_and_user_is_accepted(client):
    def sample(seed):
        return (
            client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed, user="end-user-1"
            )
            .choices[0]
            .text
        )

    first = sample(123)
    assert sample(123) == first
    assert any(sample(seed) != first for seed in (124, 125, 126))
