"""A whole benchmark (checks, warm-up, a sweep, the result) against an in-process stand-in
gRPC server: fast, no Ray. Bad input stops it before a single load request is sent."""

from __future__ import annotations

import grpc
import pytest
from baton.services.loadtest.benchmark import BenchmarkSpec, run_benchmark
from baton.services.loadtest.errors import BenchInputError
from baton.services.loadtest.lengths import LengthDistribution as L
from baton.services.loadtest.runner import Bounds, LoadSpec
from baton.services.loadtest.workloads.random import RandomWorkload, RequestClass
from loadtest_helpers import FakeInference, with_grpc_server


def spec(address, prompt_len="uniform:8:32", **options):
    workload = RandomWorkload([RequestClass("r", 1, L.parse(prompt_len), L.parse("4"))])
    defaults = {"loads": [LoadSpec(rate=200.0), LoadSpec(max_concurrency=2)], "bounds": Bounds(num_requests=6)}
    defaults["connect_timeout_s"] = 5
    return BenchmarkSpec(workload=workload, address=address, **{**defaults, **options})


def test_a_sweep_end_to_end():
    servicer = FakeInference()

    async def test(address):
        result = await run_benchmark(spec(address, warmup=2, label="fake", seed=3))
        assert servicer.num_generated == 2 + 12  # the warm-ups, then 6 per load level
        assert result["label"] == "fake" and result["server"]["model"] == "tiny"
        assert result["config"]["seed"] == 3 and result["config"]["application"] == "baton"
        assert [run["load"]["label"] for run in result["runs"]] == ["200 req/s", "concurrency 2"]
        for run in result["runs"]:
            m = run["metrics"]
            assert (m["num_completed"], m["output_tokens"], m["kv_paths"]) == (6, 24, {"colocated": 6})
            assert m["token_check"] == {"num_checked": 6, "output_mismatches": 0, "prompt_mismatches": 0}
            assert m["cached_token_ratio"] > 0  # the stand-in reports 16 cached tokens each
        lengths = [sorted(r["prompt_tokens"] for r in run["requests"]) for run in result["runs"]]
        assert lengths[0] == lengths[1]  # each run of a sweep sends the same shapes (with other tokens)

    with_grpc_server(test, servicer)


class Refusing(FakeInference):
    async def Generate(self, request, context):  # noqa: N802
        self.num_generated += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no replica")
        yield  # an async generator, like the real one


@pytest.mark.parametrize(
    "options, message",
    [
        ({"model": "other"}, "serves model 'tiny', not 'other'"),
        ({"prompt_len": "300"}, "over the server's context length 256"),
    ],
)
def test_bad_input_sends_no_load(options, message):
    servicer = FakeInference()

    async def test(address):
        with pytest.raises(BenchInputError, match=message):
            await run_benchmark(spec(address, **options))
        assert servicer.num_generated == 0

    with_grpc_server(test, servicer)


def test_the_http_backend_on_a_grpc_port():
    servicer = FakeInference()

    async def test(address):
        with pytest.raises(BenchInputError, match="cannot reach the OpenAI-compatible server"):
            await run_benchmark(spec(address, backend="openai", connect_timeout_s=2))
        assert servicer.num_generated == 0

    with_grpc_server(test, servicer)


def test_a_failing_warm_up_stops_before_the_load():
    servicer = Refusing()

    async def test(address):
        with pytest.raises(
            BenchInputError, match="warm-up request failed, so no load was sent: UNAVAILABLE: no replica"
        ):
            await run_benchmark(spec(address, warmup=3))
        assert servicer.num_generated == 1

    with_grpc_server(test, servicer)


def test_without_warm_up_failures_are_recorded_not_raised():
    async def test(address):
        result = await run_benchmark(spec(address, warmup=0, loads=[LoadSpec(rate=100.0)]))
        m = result["runs"][0]["metrics"]
        assert (m["num_requests"], m["num_failed"], m["errors"]) == (6, 6, {"UNAVAILABLE: no replica": 6})
        assert m["goodput"] == 0.0 and m["ttft_ms"]["count"] == 0

    with_grpc_server(test, Refusing())
