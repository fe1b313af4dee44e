"""The harness against a running local Baton (real Ray, real Redis, the tiny model): each
workload over gRPC, the HTTP backend against Baton's OpenAI endpoint, the command line end
to end, and `compare` on its result files. One deployment for the whole module; every run
is a few dozen short requests."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from baton.services.cli import main as baton_main
from baton.services.launcher.launcher import LocalDeployment, resolve_config
from baton.services.loadtest.benchmark import BenchmarkSpec, run_benchmark_sync
from baton.services.loadtest.errors import BenchInputError
from baton.services.loadtest.lengths import LengthDistribution as L
from baton.services.loadtest.metrics import Slo
from baton.services.loadtest.runner import Bounds, LoadSpec
from baton.services.loadtest.workloads.multi_turn import MultiTurnWorkload
from baton.services.loadtest.workloads.random import RandomWorkload, RequestClass
from baton.services.loadtest.workloads.shared_prefix import SharedPrefixWorkload
from baton.services.loadtest.workloads.sharegpt import ShareGPTWorkload
from loadtest_helpers import METRIC_KEYS
from testlib.models import tiny_model

pytestmark = pytest.mark.ray

BLOCK = 16


@pytest.fixture(scope="module")
def baton():
    config = resolve_config(
        None,
        str(tiny_model("llama")),
        {
            "mode": "colocated",
            "server": {"http_port": 0, "grpc_port": 0},
            "engine": {
                "model": {"max_model_len": 256},
                "cache": {"num_kv_blocks": 256},
                "scheduler": {"max_num_seqs": 16},
            },
            "colocated": {"ray_actor_options": {"num_cpus": 1}},
        },
    )
    with LocalDeployment(config, Path(tempfile.mkdtemp(prefix="baton-", dir="/tmp")), num_cpus=4) as deployment:
        yield deployment


def bench(baton, workload, *, backend="grpc", loads=None, num_requests=12, seed=0, **options):
    spec = BenchmarkSpec(
        workload=workload,
        loads=loads or [LoadSpec(rate=20.0)],
        bounds=Bounds(num_requests=num_requests),
        backend=backend,
        address=baton.grpc_address if backend == "grpc" else baton.http_address,
        slo=Slo(ttft_s=5.0, tpot_s=1.0),
        seed=seed,
        request_timeout_s=60,
        **options,
    )
    return run_benchmark_sync(spec)


def check_complete(result, num_requests):
    """Every metric is there, every request succeeded, and the client saw every token the server counted."""
    (run,) = result["runs"]
    m = run["metrics"]
    assert set(m) == METRIC_KEYS
    assert (m["num_requests"], m["num_completed"], m["num_failed"]) == (num_requests, num_requests, 0)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "dispatch_lag_ms"):
        assert m[key]["count"] > 0 and all(m[key][s] is not None for s in ("mean", "p50", "p90", "p99")), key
    assert m["ttft_ms"]["p50"] <= m["ttft_ms"]["p90"] <= m["ttft_ms"]["p99"] <= m["ttft_ms"]["max"]
    for key in ("request_throughput", "output_token_throughput", "total_token_throughput", "goodput"):
        assert m[key] > 0, key
    assert m["cached_token_ratio"] is not None
    assert m["token_check"]["num_checked"] == num_requests
    assert m["token_check"]["output_mismatches"] == m["token_check"]["prompt_mismatches"] == 0
    for r in run["requests"]:
        assert r["error"] is None and r["ttft_ms"] <= r["e2e_ms"]
        assert r["usage"]["completion_tokens"] == r["max_tokens"]  # ignore_eos: exact output lengths
    json.dumps(result, allow_nan=False)
    return run


def test_random_mix_over_grpc(baton):
    workload = RandomWorkload(
        [
            RequestClass("long", 1, L.parse("uniform:96:128"), L.parse("4")),
            RequestClass("short", 2, L.parse("16"), L.parse("12")),
        ]
    )
    result = bench(baton, workload, num_requests=15)
    run = check_complete(result, 15)
    assert result["server"]["model"] == "baton-tiny" and result["server"]["mode"] == "colocated"
    assert set(run["groups"]) == {"long", "short"}
    assert all(r["server_ttft_ms"] is not None for r in run["requests"])
    assert run["metrics"]["kv_paths"] == {"colocated": 15} and run["metrics"]["errors"] == {}
    assert (
        run["metrics"]["server_ttft_ms"]["p50"] <= run["metrics"]["ttft_ms"]["p50"]
    )  # the client's includes the network


def test_shared_prefix_over_grpc_hits_the_prefix_cache(baton):
    workload = SharedPrefixWorkload(2, L.parse(str(4 * BLOCK)), L.parse("8"), L.parse("4"))
    run = check_complete(bench(baton, workload, loads=[LoadSpec(rate=10.0)], num_requests=12), 12)
    # after the first request of a group, its 4 prefix blocks are cached
    hits = [r["usage"]["cached_tokens"] for r in run["requests"]]
    assert sum(h == 4 * BLOCK for h in hits) >= 8
    assert run["metrics"]["cached_token_ratio"] > 0.5
    assert set(run["groups"]) == {"prefix-000", "prefix-001"}


def test_multi_turn_over_grpc_extends_the_context(baton):
    workload = MultiTurnWorkload(3, L.parse("32"), L.parse("16"), L.parse("8"))
    run = check_complete(bench(baton, workload, loads=[LoadSpec(max_concurrency=3)], num_requests=9), 9)
    by_turn = {}
    for r in run["requests"]:
        by_turn.setdefault(r["turn"], []).append(r)
    assert {t: len(rs) for t, rs in by_turn.items()} == {0: 3, 1: 3, 2: 3}
    # turn k's prompt is the previous prompt + its 8-token reply + 16 new tokens
    assert {r["usage"]["prompt_tokens"] for r in by_turn[1]} == {32 + 8 + 16}
    assert {r["usage"]["prompt_tokens"] for r in by_turn[2]} == {56 + 8 + 16}
    # the previous prompt and reply come from the prefix cache (full blocks only)
    assert all(r["usage"]["cached_tokens"] >= 32 for r in by_turn[1] + by_turn[2])
    assert set(run["groups"]) == {"turn-1", "turn-2", "turn-3"}
    assert run["groups"]["turn-3"]["cached_token_ratio"] > run["groups"]["turn-1"]["cached_token_ratio"]


def sharegpt_file() -> Path:
    import pydoc_data.topics

    texts = sorted(t for t in pydoc_data.topics.topics.values() if len(t) > 400)
    data = [
        {
            "id": str(i),
            "conversations": [{"from": "human", "value": texts[i][:300]}, {"from": "gpt", "value": texts[-i - 1][:60]}],
        }
        for i in range(10)
    ]
    path = Path(tempfile.mkdtemp(prefix="sharegpt-")) / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_over_grpc_sized_by_the_servers_tokenizer(baton):
    run = check_complete(bench(baton, ShareGPTWorkload(sharegpt_file()), num_requests=8), 8)
    # lengths were counted with the server's Tokenize rpc: the client knew every prompt's length
    assert all(r["prompt_tokens"] == r["usage"]["prompt_tokens"] for r in run["requests"])
    assert len({r["max_tokens"] for r in run["requests"]}) > 1  # each reply's own length


def test_http_backend_against_batons_openai_endpoint(baton):
    workload = RandomWorkload([RequestClass("random", 1, L.parse("uniform:16:48"), L.parse("10"))])
    result = bench(baton, workload, backend="openai", num_requests=10, vocab_size=1000, seed=1)
    run = check_complete(result, 10)
    assert result["config"]["endpoint"] == "completions"
    assert all(r["prompt_tokens"] == r["usage"]["prompt_tokens"] for r in run["requests"])
    chat = bench(
        baton, ShareGPTWorkload(sharegpt_file(), output_len=8), backend="openai", endpoint="chat", num_requests=6
    )
    check_complete(chat, 6)


def test_multi_turn_over_http_re_tokenizes_replies(baton):
    workload = MultiTurnWorkload(2, L.parse("32"), L.parse("16"), L.parse("8"))
    tokenizer = str(tiny_model("llama"))
    result = bench(
        baton, workload, backend="openai", loads=[LoadSpec(max_concurrency=3)], num_requests=6, tokenizer=tokenizer
    )
    run = check_complete(result, 6)
    second = [r for r in run["requests"] if r["turn"] == 1]
    assert len(second) == 3 and all(r["prompt_tokens"] > 32 + 16 and r["usage"]["cached_tokens"] >= 32 for r in second)


def test_input_errors_against_a_live_server(baton):
    workload = RandomWorkload([RequestClass("r", 1, L.parse("16"), L.parse("4"))])
    with pytest.raises(BenchInputError, match="serves model 'baton-tiny', not 'llama-70b'"):
        bench(baton, workload, model="llama-70b")
    too_long = RandomWorkload([RequestClass("r", 1, L.parse("250"), L.parse("16"))])
    with pytest.raises(BenchInputError, match="266 tokens .* context length 256"):
        bench(baton, too_long)
    with pytest.raises(BenchInputError, match="does not say its vocabulary size"):
        bench(baton, workload, backend="openai")


def test_cli_sweep_then_compare(baton, tmp_path, capsys):
    common = ["bench", "run", "--address", baton.grpc_address, "--input-len", "uniform:16:64", "--output-len", "6"]
    common += ["--num-requests", "8", "--no-progress"]
    assert baton_main([*common, "--rate", "5,20", "--out", str(tmp_path / "a"), "--label", "a"]) == 0
    assert baton_main([*common, "--concurrency", "2", "--seed", "5", "--out", str(tmp_path / "b"), "--label", "b"]) == 0
    out = capsys.readouterr().out
    assert "5 req/s" in out and "20 req/s" in out and "concurrency 2" in out
    for name in ("a", "b"):
        files = {p.name for p in (tmp_path / name).iterdir()}
        assert files == {"result.json", "latency_cdf.png", "throughput_vs_rate.png", "ttft_by_group.png"}
    a = json.loads((tmp_path / "a" / "result.json").read_text())
    assert [run["load"]["rate"] for run in a["runs"]] == [5.0, 20.0]
    assert all(run["metrics"]["num_completed"] == 8 for run in a["runs"])

    files = [str(tmp_path / "a" / "result.json"), str(tmp_path / "b" / "result.json")]
    assert baton_main(["bench", "compare", *files, "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "a @ 5 req/s" in table and "a @ 20 req/s" in table and "b" in table.splitlines()[1]
    assert (tmp_path / "compare.png").stat().st_size > 10_000
