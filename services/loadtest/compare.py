"""`baton bench compare`: two or more result files side by side, as a table and a plot.

Columns are the runs of each file (label, and the load level when a file holds a sweep);
with exactly two columns a third gives their ratio (second / first). Files are read and
checked before anything is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import BenchInputError
from .plots import write_compare_plot
from .report import format_table, load_result, slo_text


def _ratio_column(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """b / a for every number both have (the table prints them with the metric's format)."""
    out: dict[str, Any] = {}
    for key, value in a.items():
        other = b.get(key)
        if isinstance(value, dict) and isinstance(other, dict):
            out[key] = _ratio_column(value, other)
        elif isinstance(value, int | float) and isinstance(other, int | float) and value:
            out[key] = other / value
        else:
            out[key] = None
    return out


def comparison_table(results: Sequence[dict[str, Any]], labels: Sequence[str]) -> str:
    columns = []
    for label, result in zip(labels, results):
        runs = result["runs"]
        for run in runs:
            columns.append((label if len(runs) == 1 else f"{label} @ {run['load']['label']}", run["metrics"]))
    slos = "; ".join(f"{label}: {slo_text(result['config'])}" for label, result in zip(labels, results))
    table = format_table(columns, f"compare: {slos}")
    if len(columns) == 2:
        ratios = _ratio_column(columns[0][1], columns[1][1])
        lines = [f"{name:<32} x{value:.2f}" for name, value in _key_ratios(ratios)]
        table += "\n\nratio (" + columns[1][0] + " / " + columns[0][0] + "):\n" + "\n".join(lines)
    return table


def _key_ratios(ratios: dict[str, Any]) -> list[tuple[str, float]]:
    wanted = [
        ("request throughput", ("request_throughput",)),
        ("goodput", ("goodput",)),
        ("output throughput", ("output_token_throughput",)),
        ("TTFT p90", ("ttft_ms", "p90")),
        ("TTFT p99", ("ttft_ms", "p99")),
        ("TPOT p90", ("tpot_ms", "p90")),
        ("TPOT p99", ("tpot_ms", "p99")),
        ("E2E p99", ("e2e_ms", "p99")),
        ("cached-token ratio", ("cached_token_ratio",)),
    ]
    out = []
    for name, path in wanted:
        value: Any = ratios
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            out.append((name, value))
    return out


def compare_files(
    paths: Sequence[str | Path],
    out_dir: str | Path | None = None,
    labels: Sequence[str] | None = None,
    plot: bool = True,
) -> tuple[str, Path | None]:
    """The comparison table, and the plot's path (written under out_dir) when asked for."""
    if len(paths) < 2:
        raise BenchInputError("compare needs two or more result files")
    results = [load_result(p) for p in paths]
    if labels is None:
        labels = [r.get("label") or Path(p).stem for r, p in zip(results, paths)]
        if len(set(labels)) != len(labels):  # same labels: tell them apart by file
            labels = [f"{label} ({Path(p).parent.name or Path(p).stem})" for label, p in zip(labels, paths)]
    elif len(labels) != len(results):
        raise BenchInputError(f"{len(labels)} labels for {len(results)} result files")
    table = comparison_table(results, labels)
    plot_path = None
    if plot:
        plot_path = write_compare_plot(results, labels, Path(out_dir or ".") / "compare.png")
    return table, plot_path
