"""PNG plots of result files (matplotlib, Agg backend: no display needed).

    latency_cdf.png        CDFs of TTFT, TPOT, ITL and E2E latency, one curve per run
    throughput_vs_rate.png request throughput and goodput, and output token throughput,
                           against the offered request rate (one point per run of a sweep)
    ttft_by_group.png      TTFT per workload group: median, with a bar from p10 to p90
    compare.png            (compare) goodput, output throughput, TTFT p90 and TPOT p99 of
                           several result files: bars for single runs, lines for sweeps

A run at an unbounded rate (fixed concurrency) has no offered rate; it is placed at its
achieved request throughput.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .metrics import percentile

MAX_GROUPS = 24  # groups shown in ttft_by_group.png (the most frequent ones)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def offered_rate(run: dict[str, Any]) -> float:
    rate = run["load"]["rate"]
    return rate if rate is not None else run["metrics"]["request_throughput"]


def _done(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in run["requests"] if r["error"] is None]


def _cdf(ax, values: list[float], label: str) -> None:
    if not values:
        return
    ordered = sorted(values)
    n = len(ordered)
    ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", label=label)


def write_run_plots(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = result["runs"]
    paths = []

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (key, title) in zip(
        axes.flat, (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency"))
    ):
        for run in runs:
            if key == "itl_ms":
                values = [gap for r in _done(run) for gap in r["itl_ms"]]
            else:
                values = [r[key] for r in _done(run) if r[key] is not None]
            _cdf(ax, values, run["load"]["label"])
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests" if key != "itl_ms" else "fraction of gaps")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{result['label']}: latency CDFs")
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "latency_cdf.png", plt))

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    xs = [offered_rate(run) for run in runs]
    left.plot(xs, [run["metrics"]["request_throughput"] for run in runs], "o-", label="request throughput")
    left.plot(xs, [run["metrics"]["goodput"] for run in runs], "s--", label="goodput (meets SLO)")
    left.set(xlabel="offered request rate (req/s)", ylabel="req/s", title="throughput and goodput")
    left.legend(fontsize=8)
    right.plot(xs, [run["metrics"]["output_token_throughput"] for run in runs], "o-")
    right.set(xlabel="offered request rate (req/s)", ylabel="tok/s", title="output token throughput")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    fig.suptitle(result["label"])
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "throughput_vs_rate.png", plt))

    fig, ax = plt.subplots(figsize=(11, 4.5))
    counts: dict[str, int] = {}
    for run in runs:
        for r in _done(run):
            counts[r["group"]] = counts.get(r["group"], 0) + 1
    groups = sorted(sorted(counts, key=lambda g: -counts[g])[:MAX_GROUPS])
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        xs, mids, lows, highs = [], [], [], []
        for x, group in enumerate(groups):
            values = [r["ttft_ms"] for r in _done(run) if r["group"] == group]
            if values:
                mid = percentile(values, 50)
                xs.append(x - 0.4 + width * (i + 0.5))
                mids.append(mid)
                lows.append(mid - percentile(values, 10))
                highs.append(percentile(values, 90) - mid)
        ax.errorbar(xs, mids, yerr=[lows, highs], fmt="o", capsize=3, label=run["load"]["label"])
    ax.set_xticks(
        range(len(groups)), groups, rotation=45 if len(groups) > 6 else 0, ha="right" if len(groups) > 6 else "center"
    )
    ax.set(ylabel="TTFT (ms)", title=f"{result['label']}: TTFT by workload group (median, p10 to p90)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "ttft_by_group.png", plt))
    return paths


_COMPARED = (
    ("goodput", ("goodput",), "goodput (req/s)"),
    ("output throughput", ("output_token_throughput",), "output tok/s"),
    ("TTFT p90", ("ttft_ms", "p90"), "ms"),
    ("TPOT p99", ("tpot_ms", "p99"), "ms"),
)


def _metric(run: dict[str, Any], path: tuple[str, ...]) -> float:
    value: Any = run["metrics"]
    for key in path:
        value = value[key]
    return float("nan") if value is None else value


def write_compare_plot(results: Sequence[dict[str, Any]], labels: Sequence[str], path: str | Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    single = all(len(result["runs"]) == 1 for result in results)
    for ax, (title, key, unit) in zip(axes.flat, _COMPARED):
        if single:
            values = [_metric(result["runs"][0], key) for result in results]
            ax.bar(range(len(labels)), values, color=[f"C{i}" for i in range(len(labels))])
            ax.set_xticks(range(len(labels)), labels, rotation=15)
            for x, v in enumerate(values):
                ax.annotate(f"{v:.3g}", (x, v), ha="center", va="bottom", fontsize=8)
        else:
            for label, result in zip(labels, results):
                runs = result["runs"]
                ax.plot([offered_rate(r) for r in runs], [_metric(r, key) for r in runs], "o-", label=label)
            ax.set_xlabel("offered request rate (req/s)")
            ax.legend(fontsize=8)
        ax.set(title=title, ylabel=unit)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, axis="y" if single else "both")
    fig.suptitle("comparison: " + " vs ".join(labels))
    fig.tight_layout()
    return _save(fig, Path(path), plt)


def _save(fig, path: Path, plt) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
