"""The autoscaling benchmark's figure (bench/autoscaling.py): matplotlib, imported only to draw it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(
    results: dict[str, dict[str, Any]], path: Path, quiet_s: float, peak_s: float, slo: tuple[float, float]
) -> None:
    """Replicas per role over time (top), and each request's TTFT and TPOT at its send time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    colors = {"fixed": "tab:gray", "serve": "tab:blue", "baton": "tab:orange"}
    for arm, r in results.items():
        t = [s["t_s"] for s in r["samples"]]
        axes[0].step(t, [s["prefill"] for s in r["samples"]], where="post", color=colors[arm], label=f"{arm} prefill")
        axes[0].step(
            t,
            [s["decode"] + 0.04 for s in r["samples"]],
            where="post",
            color=colors[arm],
            linestyle="--",
            label=f"{arm} decode",
        )
        ok = [q for q in r["requests"] if q["ok"]]
        axes[1].scatter([q["arrival_s"] for q in ok], [q["ttft_s"] for q in ok], s=6, color=colors[arm], label=arm)
        with_tpot = [q for q in ok if q["tpot_s"] is not None]
        axes[2].scatter(
            [q["arrival_s"] for q in with_tpot],
            [1000 * q["tpot_s"] for q in with_tpot],
            s=6,
            color=colors[arm],
            label=arm,
        )
    for ax in axes:
        ax.axvspan(quiet_s, quiet_s + peak_s, color="0.92", zorder=0)
    axes[1].axhline(slo[0], color="red", linewidth=0.8)
    axes[2].axhline(1000 * slo[1], color="red", linewidth=0.8)
    axes[0].set_ylim(0, 2.5)
    axes[0].set_ylabel("RUNNING replicas (decode +0.04)")
    axes[1].set_ylabel("TTFT (s)")
    axes[2].set_ylabel("TPOT (ms)")
    axes[2].set_xlabel("request sent at (s); shaded: the 3x peak; red: the SLO")
    axes[0].legend(ncol=3, fontsize=7)
    axes[1].legend(fontsize=7)
    fig.suptitle("Step load: fixed 1+1 vs Serve request-count vs Baton signal autoscaling")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
