"""Result files, the summary table, plots and `compare`, from synthetic runs (no server)."""

from __future__ import annotations

import json
import math

import pytest
from baton.services.loadtest.compare import compare_files
from baton.services.loadtest.errors import BenchInputError
from baton.services.loadtest.metrics import Slo
from baton.services.loadtest.plots import write_run_plots
from baton.services.loadtest.records import Usage
from baton.services.loadtest.report import format_summary, load_result, result_dict, write_result
from baton.services.loadtest.runner import LoadSpec, RunOutcome
from loadtest_helpers import METRIC_KEYS, record

STAT_KEYS = {"count", "mean", "std", "min", "p50", "p90", "p99", "max"}


def outcome(rate: float, scale: float = 1.0) -> RunOutcome:
    records = [
        record(
            [0.1 * scale, 0.2 * scale], 0.2 * scale, usage=Usage(50, 2, 16), group="long", index=0, prompt_tokens=50
        ),
        record(
            [0.3 * scale, 0.35 * scale, 0.4 * scale],
            0.4 * scale,
            usage=Usage(10, 3, 0),
            group="short",
            index=1,
            prompt_tokens=10,
        ),
        record([], 0.0, error="UNAVAILABLE: x", group="short", index=2),
    ]
    return RunOutcome(LoadSpec(rate=rate), records, duration_s=1.0)


def result(label="base", scale=1.0, rates=(2.0,)):
    config = {"backend": "grpc", "address": "127.0.0.1:9000", "workload": {"name": "random"}, "seed": 0}
    outcomes = [outcome(r, scale) for r in rates]
    return result_dict(label, config, {"model": "tiny"}, outcomes, Slo(ttft_s=0.2, tpot_s=0.2))


def test_result_has_every_metric_and_round_trips(tmp_path):
    data = result()
    run = data["runs"][0]
    assert set(run["metrics"]) == METRIC_KEYS
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(run["metrics"][key]) == STAT_KEYS
    m = run["metrics"]
    assert (m["num_requests"], m["num_completed"], m["num_failed"], m["num_good"]) == (3, 2, 1, 1)
    assert m["ttft_ms"]["p50"] == pytest.approx(200.0) and m["ttft_ms"]["max"] == pytest.approx(300.0)
    assert m["tpot_ms"]["mean"] == pytest.approx((100.0 + 50.0) / 2)
    assert m["server_ttft_ms"]["count"] == 0 and m["server_ttft_ms"]["p50"] is None  # NaN is written as null
    assert m["cached_token_ratio"] == pytest.approx(16 / 60)
    assert m["errors"] == {"UNAVAILABLE: x": 1} and m["kv_paths"] == {}
    assert data["config"]["slo_ms"] == {"ttft_s": pytest.approx(200.0), "tpot_s": pytest.approx(200.0), "e2e_s": None}
    assert set(run["groups"]) == {"long", "short"} and run["groups"]["short"]["num_requests"] == 2
    assert [r["meets_slo"] for r in run["requests"]] == [True, False, False]
    assert run["requests"][1]["itl_ms"] == pytest.approx([50.0, 50.0])
    assert run["load"] == {"label": "2 req/s", "rate": 2.0, "burstiness": 1.0, "max_concurrency": None}

    path = write_result(data, tmp_path / "out" / "result.json")
    assert load_result(path) == json.loads(json.dumps(data))


def test_unbounded_rate_is_written_as_null():
    data = result_dict("x", {}, {}, [RunOutcome(LoadSpec(rate=math.inf, max_concurrency=4), [], 0.0)], Slo())
    assert data["runs"][0]["load"]["rate"] is None
    json.dumps(data, allow_nan=False)


def test_summary_table(tmp_path):
    text = format_summary(result(rates=(2.0, 4.0)))
    lines = text.splitlines()
    assert lines[0].startswith("base: grpc 127.0.0.1:9000, model tiny, workload random, seed 0, SLO TTFT <= 200 ms")
    assert "2 req/s" in lines[1] and "4 req/s" in lines[1]
    row = {line[:32].strip(): line[32:].split() for line in lines[3:]}
    assert row["requests ok / sent"] == ["2", "/", "3", "2", "/", "3"]
    assert row["requests meeting SLO"] == ["1", "(33%)", "1", "(33%)"]  # of those sent: a failure misses it
    assert row["TTFT p50 (ms)"] == ["200.0", "200.0"]
    assert row["token check (client vs server)"] == ["ok", "ok"]
    assert row["cached-token ratio"] == ["26.7%", "26.7%"]
    assert len(lines) < 40  # one screen


def test_many_runs_get_a_row_each():
    lines = format_summary(result(rates=(1.0, 2.0, 3.0, 4.0, 5.0))).splitlines()
    assert lines[1] == "(latencies in ms)"
    assert lines[2].split()[:4] == ["run", "ok", "req/s", "goodput"]
    rows = [line.split() for line in lines[4:]]
    assert [row[:2] for row in rows] == [["1", "req/s"], ["2", "req/s"], ["3", "req/s"], ["4", "req/s"], ["5", "req/s"]]
    assert all(row[2:5] == ["2", "/", "3"] and row[7] == "33%" for row in rows)


def test_plots_are_written(tmp_path):
    paths = write_run_plots(result(rates=(1.0, 2.0, 4.0)), tmp_path)
    assert [p.name for p in paths] == ["latency_cdf.png", "throughput_vs_rate.png", "ttft_by_group.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_compare_two_files(tmp_path):
    a = write_result(result("colocated"), tmp_path / "a" / "result.json")
    b = write_result(result("disaggregated", scale=0.5), tmp_path / "b" / "result.json")
    table, plot = compare_files([a, b], tmp_path)
    assert "colocated" in table.splitlines()[1] and "disaggregated" in table.splitlines()[1]
    assert "TTFT p90" in table and "x0.50" in table  # every latency halved
    assert plot == tmp_path / "compare.png" and plot.stat().st_size > 10_000


def test_compare_sweeps_and_labels(tmp_path):
    a = write_result(result("x", rates=(1.0, 2.0)), tmp_path / "a" / "result.json")
    b = write_result(result("x", rates=(1.0, 2.0)), tmp_path / "b" / "result.json")
    table, plot = compare_files([a, b], tmp_path, plot=False)
    assert plot is None
    assert "x (a) @ 1 req/s" in table and "x (b) @ 2 req/s" in table  # same labels told apart by folder
    table, _ = compare_files([a, b], tmp_path, labels=["left", "right"])
    assert "left @ 1 req/s" in table


def test_compare_input_errors(tmp_path):
    good = write_result(result(), tmp_path / "r.json")
    with pytest.raises(BenchInputError, match="two or more"):
        compare_files([good])
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(BenchInputError, match="not valid JSON"):
        compare_files([good, tmp_path / "bad.json"])
    (tmp_path / "other.json").write_text('{"hello": 1}')
    with pytest.raises(BenchInputError, match="not a `baton bench run` result file"):
        compare_files([good, tmp_path / "other.json"])
    with pytest.raises(BenchInputError, match="cannot read"):
        compare_files([good, tmp_path / "missing.json"])
    with pytest.raises(BenchInputError, match="1 labels for 2"):
        compare_files([good, good], labels=["one"])
