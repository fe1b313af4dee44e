"""The result file (JSON) and the one-screen summary table.

A result file holds the benchmark's configuration, what the server said about itself, and
one entry per run (load level) with its aggregate metrics, per-group metrics and every
request's record. Latencies are in milliseconds, throughputs per second. The table is built
from the same dictionaries, so `compare` can print one from files alone.

    {"schema": "baton-bench/1", "label", "created", "config", "server",
     "runs": [{"load", "metrics", "host", "groups", "requests": [...]}, ...]}

`host` records the client machine's load average around each run: when the server shares
the machine, other jobs running beside it skew every latency.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .errors import BenchInputError
from .metrics import GroupMetrics, RunMetrics, Slo, Stats, group_metrics, meets_slo, request_metrics, run_metrics
from .records import RequestRecord
from .runner import RunOutcome

SCHEMA = "baton-bench/1"
LATENCIES = ("ttft", "tpot", "itl", "e2e")


def _ms(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else value * 1000.0


def _number(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else value


def stats_ms(stats: Stats) -> dict[str, Any]:
    return {"count": stats.count, **{k: _ms(v) for k, v in asdict(stats).items() if k != "count"}}


def metrics_dict(m: RunMetrics) -> dict[str, Any]:
    return {
        "num_requests": m.num_requests,
        "num_completed": m.num_completed,
        "num_failed": m.num_failed,
        "num_good": m.num_good,
        "duration_s": m.duration_s,
        "request_throughput": m.request_throughput,
        "output_token_throughput": m.output_token_throughput,
        "total_token_throughput": m.total_token_throughput,
        "goodput": m.goodput,
        "ttft_ms": stats_ms(m.ttft),
        "tpot_ms": stats_ms(m.tpot),
        "itl_ms": stats_ms(m.itl),
        "e2e_ms": stats_ms(m.e2e),
        "server_ttft_ms": stats_ms(m.server_ttft),
        "dispatch_lag_ms": stats_ms(m.dispatch_lag),
        "prompt_tokens": m.prompt_tokens,
        "output_tokens": m.output_tokens,
        "cached_tokens": m.cached_tokens,
        "cached_token_ratio": m.cached_token_ratio,
        "token_check": asdict(m.tokens),
        "kv_paths": m.kv_paths,
        "errors": m.errors,
    }


def group_dict(g: GroupMetrics) -> dict[str, Any]:
    return {
        "num_requests": g.num_requests,
        "num_completed": g.num_completed,
        "num_good": g.num_good,
        "ttft_ms": stats_ms(g.ttft),
        "tpot_ms": stats_ms(g.tpot),
        "e2e_ms": stats_ms(g.e2e),
        "cached_token_ratio": g.cached_token_ratio,
    }


def record_dict(record: RequestRecord, slo: Slo) -> dict[str, Any]:
    m = request_metrics(record)
    r = record.response
    return {
        "index": record.index,
        "session": record.session_id,
        "turn": record.turn,
        "group": record.group,
        "scheduled_s": record.scheduled_s,
        "start_s": record.start_s,
        "prompt_tokens": record.prompt_tokens,
        "max_tokens": record.max_tokens,
        "output_tokens_client": r.num_output_tokens,
        "usage": asdict(r.usage) if r.usage is not None else None,
        "ttft_ms": _ms(m.ttft_s),
        "tpot_ms": _ms(m.tpot_s),
        "e2e_ms": _ms(m.e2e_s),
        "itl_ms": [_ms(gap) for gap in m.itl_s],
        "meets_slo": meets_slo(m, slo),
        "server_ttft_ms": _ms(r.server_ttft_s),
        "kv_path": r.kv_path,
        "prefill_worker": r.prefill_worker,
        "decode_worker": r.decode_worker,
        "finish_reason": r.finish_reason,
        "error": r.error,
    }


def run_dict(outcome: RunOutcome, slo: Slo) -> dict[str, Any]:
    records = sorted(outcome.records, key=lambda r: r.index)
    load = outcome.load
    return {
        "load": {
            "label": load.label(),
            "rate": None if math.isinf(load.rate) else load.rate,  # JSON has no inf: null is "all at once"
            "burstiness": load.burstiness,
            "max_concurrency": load.max_concurrency,
        },
        "metrics": metrics_dict(run_metrics(records, outcome.duration_s, slo)),
        "host": {
            "cpus": os.cpu_count(),
            "loadavg_1m_start": outcome.host_load[0],
            "loadavg_1m_end": outcome.host_load[1],
        },
        "groups": {name: group_dict(g) for name, g in group_metrics(records, slo).items()},
        "requests": [record_dict(r, slo) for r in records],
    }


def result_dict(
    label: str, config: dict[str, Any], server: dict[str, Any], outcomes: Sequence[RunOutcome], slo: Slo
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "label": label,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": {**config, "slo_ms": {k: _ms(v) for k, v in asdict(slo).items()}},
        "server": server,
        "runs": [run_dict(o, slo) for o in outcomes],
    }


def write_result(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, allow_nan=False))
    return path


def load_result(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        result = json.loads(path.read_text())
    except OSError as e:
        raise BenchInputError(f"cannot read the result file {path}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise BenchInputError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}") from e
    if not isinstance(result, dict) or result.get("schema") != SCHEMA or not isinstance(result.get("runs"), list):
        raise BenchInputError(f"{path} is not a `baton bench run` result file (schema {SCHEMA})")
    return result


# -- the table -------------------------------------------------------------------------------

# (row label, path into a run's metrics, format)
_ROWS: list[tuple[str, tuple[str, ...], str]] = [
    ("requests ok / sent", (), "ok"),
    ("duration (s)", ("duration_s",), "{:.1f}"),
    ("request throughput (req/s)", ("request_throughput",), "{:.2f}"),
    ("goodput (req/s)", ("goodput",), "{:.2f}"),
    ("requests meeting SLO", (), "good"),
    ("output throughput (tok/s)", ("output_token_throughput",), "{:.1f}"),
    ("total throughput (tok/s)", ("total_token_throughput",), "{:.1f}"),
    *[
        (f"{name.upper()} {stat} (ms)", (f"{name}_ms", stat), "{:.1f}")
        for name in LATENCIES
        for stat in ("mean", "p50", "p90", "p99")
    ],
    ("cached-token ratio", ("cached_token_ratio",), "{:.1%}"),
    ("token check (client vs server)", (), "tokens"),
    ("KV paths (server)", (), "kv_paths"),
    ("dispatch lag p99 (ms)", ("dispatch_lag_ms", "p99"), "{:.1f}"),
]


def _cell(metrics: dict[str, Any], path: tuple[str, ...], fmt: str) -> str:
    if fmt == "ok":
        return f"{metrics['num_completed']} / {metrics['num_requests']}"
    if fmt == "good":  # attainment over every request sent: a failed one misses the SLO
        sent = metrics["num_requests"]
        return f"{metrics['num_good']} ({metrics['num_good'] / sent:.0%})" if sent else "0"
    if fmt == "attainment":
        sent = metrics["num_requests"]
        return f"{metrics['num_good'] / sent:.0%}" if sent else "-"
    if fmt == "kv_paths":
        paths = metrics.get("kv_paths") or {}
        return ", ".join(f"{name} {count}" for name, count in sorted(paths.items())) or "-"
    if fmt == "tokens":
        check = metrics["token_check"]
        bad = check["output_mismatches"] + check["prompt_mismatches"]
        return "no usage" if not check["num_checked"] else ("ok" if not bad else f"{bad} differ")
    value: Any = metrics
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return "-" if value is None else fmt.format(value)


# The long form, one row per run, when there are too many runs for one column each.
_WIDE_AFTER = 4
_COMPACT: list[tuple[str, tuple[str, ...], str]] = [
    ("ok", (), "ok"),
    ("req/s", ("request_throughput",), "{:.2f}"),
    ("goodput", ("goodput",), "{:.2f}"),
    ("SLO met", (), "attainment"),
    ("out tok/s", ("output_token_throughput",), "{:.1f}"),
    *[(f"{name.upper()} {stat}", (f"{name}_ms", stat), "{:.1f}") for name, stat in (
        ("ttft", "p50"), ("ttft", "p90"), ("ttft", "p99"), ("tpot", "p50"), ("tpot", "p99"), ("itl", "p99"), ("e2e", "p99")
    )],
    ("cached", ("cached_token_ratio",), "{:.0%}"),
    ("tokens", (), "tokens"),
]  # fmt: skip


def _layout(rows: list[list[str]], title: str) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [title] if title else []
    for n, row in enumerate(rows):
        lines.append(
            "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_table(columns: Sequence[tuple[str, dict[str, Any]]], title: str = "") -> str:
    """Metrics of several runs: a column per run, or with more than a few runs a row per run
    (fewer metrics, latencies in ms)."""
    if len(columns) > _WIDE_AFTER:
        header = ["run", *[name for name, _, _ in _COMPACT]]
        rows = [[label, *[_cell(m, path, fmt) for _, path, fmt in _COMPACT]] for label, m in columns]
        return _layout([header, *rows], f"{title}\n(latencies in ms)" if title else "(latencies in ms)")
    header = ["", *[label for label, _ in columns]]
    rows = [[name, *[_cell(m, path, fmt) for _, m in columns]] for name, path, fmt in _ROWS]
    return _layout([header, *rows], title)


def slo_text(config: dict[str, Any]) -> str:
    slo = config.get("slo_ms") or {}
    parts = [
        f"{name.upper()} <= {slo[key]:g} ms"
        for key, name in (("ttft_s", "ttft"), ("tpot_s", "tpot"), ("e2e_s", "e2e"))
        if slo.get(key)
    ]
    return "SLO " + (", ".join(parts) if parts else "none")


def format_summary(result: dict[str, Any]) -> str:
    config = result["config"]
    workload = config.get("workload", {})
    title = (
        f"{result['label']}: {config.get('backend')} {config.get('address')}, model {result['server'].get('model')}, "
        f"workload {workload.get('name')}, seed {config.get('seed')}, {slo_text(config)}"
    )
    columns = [(run["load"]["label"], run["metrics"]) for run in result["runs"]]
    return format_table(columns, title)
