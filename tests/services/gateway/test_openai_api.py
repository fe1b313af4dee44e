"""The OpenAI-compatible HTTP API, driven by the unmodified `openai` client."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.api.tokenizer import load_tokenizer
from baton.services.gateway.request_limits import RequestLimits
from baton.services.ray_env import SERVE_ENV
from testlib.baton_client import worker_stats
from testlib.models import tiny_model
from testlib.ray_processes import environment, replica_pids, script_pids, titled_pids

from .beside import check_no_one_held_up, counter_value, wait_for_counter

pytestmark = pytest.mark.ray
MODEL = "baton-tiny"


@pytest.fixture(scope="module")
def client(baton_app):
    return openai.OpenAI(base_url=f"{baton_app.http_address}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline():
    return LLM(model=str(tiny_model("llama")), num_kv_blocks=128, max_model_len=256)


def greedy(llm, prompt, max_tokens=12):
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion(client, offline):
    expected = greedy(offline, "def foo(x):")
    response = client.completions.create(
        model=MODEL, prompt="def foo(x):", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == 12


def test_completion_streaming(client, offline):
    expected = greedy(offline, "The quick brown fox")
    stream = client.completions.create(
        model=MODEL,
        prompt="The quick brown fox",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_completion(client, offline):
    messages = [{"role": "user", "content": "Say something"}]
    prompt_ids = load_tokenizer(tiny_model("llama")).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    expected = greedy(offline, prompt_ids)
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    unasked = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True)
    assert all(c.usage is None for c in unasked)  # usage only with include_usage, as OpenAI defines it


def test_chat_logprobs(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in content)


def test_bad_parameter_is_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "temperature" and "temperature" in info.value.body["message"]


def test_malformed_body_is_400(baton_app):
    reply = httpx.post(f"{baton_app.http_address}/v1/completions", json={"model": MODEL, "max_tokens": "many"})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


def test_prompt_over_the_context_limit_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[7] * 300, max_tokens=4)
    assert "300" in info.value.body["message"] and "256" in info.value.body["message"]


def test_prompt_plus_max_tokens_over_the_context_is_400_with_the_numbers(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[7] * 250, max_tokens=10)
    assert info.value.body["param"] == "max_tokens"
    assert all(n in info.value.body["message"] for n in ("250 tokens", "max_tokens is 10", "256"))
    fits = client.completions.create(model=MODEL, prompt=[7] * 250, max_tokens=6, extra_body={"ignore_eos": True})
    assert fits.usage.completion_tokens == 6


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-7", prompt="hi")


def test_overload_is_429_with_retry_after_and_counted_as_shed(baton_app):
    shed_before = counter_value(baton_app.metrics_address, "baton_requests_shed_total", api="http")
    codes, retry_after = [], []

    def post(i):
        body = {"model": MODEL, "prompt": f"busy {i}", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{baton_app.http_address}/v1/completions", json=body, timeout=120)
        codes.append(reply.status_code)
        if reply.status_code == 429:
            retry_after.append((reply.headers.get("retry-after"), reply.json()["error"].get("retry_after")))

    threads = [threading.Thread(target=post, args=(i,)) for i in range(70)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert 429 in codes and codes.count(200) >= 16
    assert retry_after and all(header.isdigit() and int(header) == body >= 1 for header, body in retry_after), (
        retry_after
    )
    shed = wait_for_counter(
        baton_app.metrics_address, "baton_requests_shed_total", shed_before + codes.count(429), api="http"
    )
    assert shed >= shed_before + codes.count(429)


def test_client_disconnect_aborts_frees_blocks_and_counts_as_cancelled(baton_app):
    counted = {"finish_reason": "cancelled", "api": "http"}
    before = counter_value(baton_app.metrics_address, "baton_requests_total", **counted)
    body = {
        "model": MODEL,
        "prompt": "a long story",
        "max_tokens": 230,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{baton_app.http_address}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        next(response.iter_lines())
    deadline = time.monotonic() + 10
    while True:
        stats = worker_stats()
        if stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == 0:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    after = wait_for_counter(baton_app.metrics_address, "baton_requests_total", before + 1, **counted)
    print(f"\nbaton_requests_total{{finish_reason=cancelled,api=http}}: {before} -> {after}")
    assert after >= before + 1


@pytest.mark.parametrize("kind", ["http", "http-chunked"])
def test_a_10mb_body_is_413_and_holds_no_one_up(baton_app, kind):
    """A 10 MB body gets a 413 naming the limit (from its Content-Length, or counted as it
    streams in); small completions sent meanwhile (the big ones come from another process)
    take about as long as alone."""
    limit = RequestLimits().max_request_bytes
    http = httpx.Client(timeout=30)

    def small():
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        reply = http.post(f"{baton_app.http_address}/v1/completions", json=body)
        assert reply.status_code == 200, reply.text

    what = f"HTTP body of 10 MB ({kind})"
    measured = check_no_one_held_up(small, kind, "http-proxy", baton_app.http_address, what)
    for outcome in measured.big_results:
        assert outcome["status"] == 413, outcome
        assert f"limit of {limit} bytes (server.limits.max_request_bytes)" in outcome["message"]


def test_serve_processes_start_with_serve_env(baton_app):
    """The launcher starts Ray with SERVE_ENV, so each replica and the controller read it."""
    pids = replica_pids("gateway") + replica_pids("colocated") + titled_pids("ray::ServeController")
    assert len(pids) == 3, pids
    for pid in pids:
        env = environment(pid)
        assert SERVE_ENV.items() <= env.items(), (pid, {k: v for k, v in env.items() if "SERVE" in k})


def test_the_ray_baton_starts_runs_no_log_monitor(baton_app):
    """Nothing prints Ray's log lines (log_to_driver=False), so the launcher stops the process
    that tails them; Ray's other daemons (the autoscaler's monitor among them) still run."""
    assert script_pids("monitor.py"), "the finder sees none of Ray's daemons"
    assert script_pids("log_monitor.py") == []
    assert any(baton_app.ray_logs_dir.glob("*.log")), "the processes' own log files are still written"
