"""The gRPC API on a real local Ray Serve deployment: equals the offline engine, streams
correctly, reports usage, maps every error, frees blocks on cancel and on deadlines."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from baton.services.client import BatonClient
from baton.services.engine import LLM, SamplingParams
from baton.services.gateway.request_limits import RequestLimits
from baton.v1 import inference_pb2 as pb
from testlib.baton_client import collect, greedy_request, worker_stats
from testlib.models import tiny_model

from .beside import check_no_one_held_up, counter_value, wait_for_counter

pytestmark = pytest.mark.ray
PROMPTS = ["def foo(x):", "The quick brown fox", "import os\nimport sys\n", "Hello there, how are you"]


@pytest.fixture(scope="module")
def client(baton_app):
    client = BatonClient(baton_app.grpc_address)
    yield client
    client.close()


@pytest.fixture(scope="module")
def offline():
    llm = LLM(model=str(tiny_model("llama")), num_kv_blocks=128, max_model_len=256)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    return {"llm": llm, **{p: out for p, out in zip(PROMPTS, llm.generate(PROMPTS, params))}}


def wait_for_free_blocks(timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        stats = worker_stats()
        if stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def test_greedy_equals_offline_engine_and_deltas_add_up(client, offline):
    for prompt in PROMPTS:
        responses = collect(client, greedy_request(prompt))
        tokens = [t for r in responses for t in r.token_ids]
        assert tokens == offline[prompt].token_ids
        assert "".join(r.text for r in responses) == offline[prompt].text
        last = responses[-1]
        assert last.finish_reason == "length"
        assert last.usage.prompt_tokens == len(offline[prompt].prompt_token_ids)
        assert last.usage.completion_tokens == 16
        assert last.timings.time_to_first_token_s > 0 and last.timings.total_s >= last.timings.time_to_first_token_s
        assert all(not r.HasField("usage") for r in responses[:-1])
        assert len({r.request_id for r in responses}) == 1


def test_token_id_prompt_and_cached_tokens(client, offline):
    prompt_ids = offline[PROMPTS[2]].prompt_token_ids * 4  # > 2 blocks
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt_ids), sampling=pb.SamplingParameters(max_tokens=4, temperature=0)
    )
    first = collect(client, request)[-1]
    second = collect(client, request)[-1]
    assert first.usage.prompt_tokens == len(prompt_ids)
    assert second.usage.cached_tokens == (len(prompt_ids) - 1) // 16 * 16


def test_n_samples_stream_with_their_index(client):
    request = pb.GenerateRequest(
        text="Once", sampling=pb.SamplingParameters(max_tokens=6, temperature=1.0, n=3, seed=5)
    )
    responses = collect(client, request)
    per_index = {i: [t for r in responses if r.index == i for t in r.token_ids] for i in range(3)}
    assert all(len(tokens) == 6 for tokens in per_index.values())
    assert responses[-1].usage.completion_tokens == 18


def test_logprobs_stream(client):
    responses = collect(client, greedy_request("Hello", max_tokens=3, logprobs=2))
    entries = [lp for r in responses for lp in r.logprobs]
    assert len(entries) == 3
    assert all(e.rank == 1 and len(e.top_logprobs) == 2 and e.top_logprobs[0].token_id == e.token_id for e in entries)


def test_tokenize_and_model_info(client):
    tokens = client.stub.Tokenize(pb.TokenizeRequest(text="def foo(x):"), metadata=client.metadata)
    assert tokens.count == len(tokens.token_ids) > 0
    info = client.model_info()
    assert (info.model, info.max_context_length, info.block_size, info.tensor_parallel_size) == (
        "baton-tiny",
        256,
        16,
        1,
    )
    assert list(info.roles) == ["colocated"] and info.mode == "colocated"
    assert info.router == "prefix_aware"  # the local deployment starts a Redis for the router


def test_health_check(baton_app):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(baton_app.grpc_address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "baton.v1.Inference"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), metadata=(("application", "baton"),))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), metadata=(("application", "baton"),))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    "data,problem",
    [
        (b"\xff\xff\xff", "the bytes are not a valid protobuf encoding of it"),
        (b"\x0a\x02\xc3\x28", "a string field is not valid UTF-8"),
    ],
)
def test_malformed_bytes_are_invalid_argument_saying_why(baton_app, data, problem):
    with grpc.insecure_channel(baton_app.grpc_address) as channel:
        generate = channel.unary_stream(
            "/baton.v1.Inference/Generate", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        with pytest.raises(grpc.RpcError) as info:
            list(generate(data, metadata=(("application", "baton"),), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == f"the request is not a valid baton.v1.GenerateRequest message: {problem}"


def test_rejections_leave_no_traceback_in_serve_logs(baton_app, client):
    logs = baton_app.ray_logs_dir / "serve"
    # Serve's proxy names the method; a direct-ingress gateway replica logs the call alone.
    direct = baton_app.config.server.direct_ingress
    access_line = "-- CALL baton INVALID_ARGUMENT" if direct else "/baton.v1.Inference/Generate baton INVALID_ARGUMENT"

    def serve_logs() -> str:
        return "".join(path.read_text(errors="replace") for path in logs.glob("*.log"))

    before = serve_logs().count(access_line)
    with pytest.raises(grpc.RpcError):
        collect(client, pb.GenerateRequest(text="reject me", sampling=pb.SamplingParameters(top_p=0)))
    deadline = time.monotonic() + 10
    while (text := serve_logs()).count(access_line) == before and time.monotonic() < deadline:
        time.sleep(0.2)  # the access line comes after any traceback the server would write
    assert text.count(access_line) > before
    assert "InvalidRequestError" not in text and "gRPCStatusError" not in text


@pytest.mark.parametrize(
    "sampling,field",
    [
        (pb.SamplingParameters(temperature=-1), "temperature"),
        (pb.SamplingParameters(top_p=0), "top_p"),
        (pb.SamplingParameters(top_k=0), "top_k"),
        (pb.SamplingParameters(max_tokens=0), "max_tokens"),
        (pb.SamplingParameters(n=0), "n"),
        (pb.SamplingParameters(stop_token_ids=[99999]), "stop_token_ids"),
    ],
)
def test_invalid_parameters_are_invalid_argument_naming_the_field(client, sampling, field):
    with pytest.raises(grpc.RpcError) as info:
        collect(client, pb.GenerateRequest(text="hi", sampling=sampling))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()


def test_unset_fields_mean_defaults_not_zero(client):
    responses = collect(client, pb.GenerateRequest(text="hi"))  # max_tokens 16, temperature 1.0
    assert sum(len(r.token_ids) for r in responses) in range(1, 17)


def test_prompt_over_the_context_limit(client):
    with pytest.raises(grpc.RpcError) as info:
        collect(client, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 300)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "300" in info.value.details() and "256" in info.value.details()


def test_prompt_plus_max_tokens_over_the_context_is_refused_not_capped(client):
    sampling = pb.SamplingParameters(max_tokens=10, temperature=0, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as info:
        collect(client, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 250), sampling=sampling))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert all(n in info.value.details() for n in ("250 tokens", "max_tokens is 10", "256"))
    sampling.max_tokens = 6
    responses = collect(client, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 250), sampling=sampling))
    assert sum(len(r.token_ids) for r in responses) == 6


def test_missing_prompt(client):
    with pytest.raises(grpc.RpcError) as info:
        collect(client, pb.GenerateRequest())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in info.value.details()


def test_cancelled_stream_frees_its_blocks(client):
    stream = client.generate(greedy_request("a long story", max_tokens=200))
    next(stream)
    stream.cancel()
    stats = wait_for_free_blocks()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == 0


def test_deadline_is_honoured_and_frees_blocks(client):
    with pytest.raises(grpc.RpcError) as info:
        collect(client, greedy_request("a long story", max_tokens=230), timeout=0.05)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = wait_for_free_blocks()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def timed(fn) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def test_cancels_and_deadlines_count_as_cancelled_not_as_errors(baton_app, client):
    counted = {"finish_reason": "cancelled", "api": "grpc"}
    before = counter_value(baton_app.metrics_address, "baton_requests_total", **counted)
    internal = counter_value(baton_app.metrics_address, "baton_requests_total", finish_reason="error:INTERNAL")
    stream = client.generate(greedy_request("cancel me", max_tokens=200))
    next(stream)
    stream.cancel()
    after_cancel = wait_for_counter(baton_app.metrics_address, "baton_requests_total", before + 1, **counted)
    assert after_cancel >= before + 1, "a client's cancel was not counted as cancelled"
    # The deadline must pass mid-stream: after a token came (so the gateway had the request;
    # one that passes before the request is handed on is counted nowhere), before the last.
    # Fractions of this machine's time for the whole stream, until one lands there.
    request = greedy_request("a long story", max_tokens=230)
    whole_s = min(timed(lambda: collect(client, request)) for _ in range(2))
    for fraction in (0.5, 0.3, 0.7):
        received = 0
        with pytest.raises(grpc.RpcError) as info:
            for _ in client.generate(request, timeout=fraction * whole_s):
                received += 1
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        if received:
            break
    assert received, f"no deadline passed after a token came (the whole stream takes {whole_s:.2f} s)"
    after = wait_for_counter(baton_app.metrics_address, "baton_requests_total", after_cancel + 1, 10, **counted)
    print(f"\nbaton_requests_total{{finish_reason=cancelled,api=grpc}}: {before} -> {after}")
    assert after >= before + 2, "a deadline passed mid-stream was not counted as cancelled"
    assert counter_value(baton_app.metrics_address, "baton_requests_total", finish_reason="error:INTERNAL") == internal
    wait_for_free_blocks()


@pytest.mark.parametrize("rpc", ["Tokenize", "Generate"])
def test_a_10mb_message_is_refused_and_holds_no_one_up(baton_app, client, rpc):
    """A 10 MB message gets RESOURCE_EXHAUSTED naming the limit; small requests sent while
    such messages arrive one after the other (from another process) take about as long as
    alone."""
    limit = RequestLimits().max_request_bytes
    small = lambda: collect(client, greedy_request("hi", max_tokens=1))  # noqa: E731
    kind, address = f"grpc-{rpc.lower()}", baton_app.grpc_address
    measured = check_no_one_held_up(small, kind, "grpc-proxy", address, f"gRPC {rpc} of 10 MB")
    for outcome in measured.big_results:
        assert outcome["status"] == "RESOURCE_EXHAUSTED", outcome
        assert f"over the limit of {limit} bytes (server.limits.max_request_bytes)" in outcome["message"]


def test_abort_by_id(client):
    stream = client.generate(
        pb.GenerateRequest(
            request_id="to-abort",
            text="story",
            sampling=pb.SamplingParameters(max_tokens=230, temperature=0, ignore_eos=True),
        )
    )
    next(stream)
    assert client.stub.Abort(pb.AbortRequest(request_id="to-abort"), metadata=client.metadata).found
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    assert not client.stub.Abort(pb.AbortRequest(request_id="to-abort"), metadata=client.metadata).found
    wait_for_free_blocks()


def test_overload_is_resource_exhausted_with_retry_after(client):
    # More concurrent requests than max_num_seqs (16) + max_waiting_requests (40), by enough
    # that the queue passes its bound even though the first ones finish while the last arrive.
    streams = [client.generate(greedy_request(f"busy {i}", max_tokens=200)) for i in range(120)]
    codes, retry_after = [], []

    def drain(stream):
        try:
            for _ in stream:
                pass
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            codes.append(e.code())
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                retry_after.append((dict(e.trailing_metadata() or ()).get("retry-after"), e.details()))

    threads = [threading.Thread(target=drain, args=(s,)) for s in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert codes.count(grpc.StatusCode.OK) >= 16
    assert retry_after and all(
        seconds.isdigit() and details.endswith(f"(retry after {seconds} s)") for seconds, details in retry_after
    ), retry_after
    wait_for_free_blocks()


def test_fifty_concurrent_streams(client, offline):
    results: dict[int, list[int]] = {}

    def run(i: int):
        prompt = PROMPTS[i % len(PROMPTS)]
        results[i] = [t for r in collect(client, greedy_request(prompt)) for t in r.token_ids]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert len(results) == 50
    for i, tokens in results.items():
        assert tokens == offline[PROMPTS[i % len(PROMPTS)]].token_ids


def test_prometheus_metrics_are_exported(baton_app, client):
    import httpx

    collect(client, greedy_request("metrics please", 4))
    wanted = [
        "baton_time_to_first_token_seconds",
        "baton_requests_total",
        "baton_num_requests_running",
        "baton_kv_cache_usage_ratio",
        "baton_router_decisions_total",
        "baton_step_seconds",
    ]
    deadline = time.monotonic() + 40
    while True:
        text = httpx.get(baton_app.metrics_address, timeout=10).text
        missing = [name for name in wanted if name not in text]
        if not missing:
            break
        assert time.monotonic() < deadline, f"missing {missing} at {baton_app.metrics_address}"
        time.sleep(1)


def test_logit_bias_prompt_logprobs_and_best_of_equal_the_offline_engine(client, offline):
    llm = offline["llm"]
    prompt = PROMPTS[1]
    prompt_ids = offline[prompt].prompt_token_ids
    favoured = offline[prompt].token_ids[3]  # the bias makes it every greedy token
    sampling = pb.SamplingParameters(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=2)
    sampling.logit_bias[favoured] = 100.0
    responses = collect(client, pb.GenerateRequest(text=prompt, sampling=sampling))
    expected = llm.generate(
        [prompt],
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=2, logit_bias={favoured: 100.0}),
    )[0]
    assert [t for r in responses for t in r.token_ids] == expected.token_ids == [favoured] * 6
    scored = responses[0].prompt_logprobs
    assert [e.token_id for e in scored] == prompt_ids[1:]
    for entry, entries in zip(scored, expected.prompt_logprobs[1:]):
        assert entry.logprob == pytest.approx(entries[entry.token_id].logprob, abs=1e-4)
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    assert all(not r.prompt_logprobs for r in responses[1:])

    best = pb.SamplingParameters(max_tokens=5, temperature=1.0, seed=11, n=2, best_of=4, ignore_eos=True)
    responses = collect(client, pb.GenerateRequest(text=prompt, sampling=best))
    kept = llm.generate(
        [prompt], SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=2, best_of=4, ignore_eos=True)
    )
    by_index = {r.index: list(r.token_ids) for r in responses if r.token_ids}
    assert by_index == {i: c.token_ids for i, c in enumerate(kept[0].outputs)}


@pytest.mark.parametrize(
    "sampling,field",
    [
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"n": 10**6}, "n"),
        ({"prompt_logprobs": 10**6}, "prompt_logprobs"),
    ],
)
def test_bad_sampling_extensions_name_the_field(client, sampling, field):
    with pytest.raises(grpc.RpcError) as info:
        collect(client, greedy_request("hi", max_tokens=2, **sampling))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()


def test_a_logit_bias_outside_the_vocabulary_names_the_field(client):
    sampling = pb.SamplingParameters(max_tokens=2)
    sampling.logit_bias[10**6] = 1.0
    with pytest.raises(grpc.RpcError) as info:
        collect(client, pb.GenerateRequest(text="hi", sampling=sampling))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in info.value.details()
