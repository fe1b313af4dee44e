"""The offline and prefix modes of bench/peer_vllm.py (its docstring says what each measures
and how runs alternate): the jobs they build and the tables they print."""

from __future__ import annotations

import argparse
import sys
from statistics import mean

from common import mixed_workload, pick
from peer_vllm import agreement, alternate, job_for, print_ratios, rows, save

DTYPES = ("float32", "bfloat16")


def selected_dtypes(keys: str | None) -> tuple[str, ...]:
    """`--dtypes float32`: those dtypes; None: both."""
    return pick("--dtypes", keys, DTYPES)


def run_offline(args: argparse.Namespace) -> None:
    num = 16 if args.quick else 64
    requests = mixed_workload(num, (16, 512), (16, 256), vocab_size=8192, seed=0)
    useful = sum(r.max_tokens for r in requests)
    print(f"offline: {num} requests (bench/engine.py throughput), {useful} output tokens, {args.runs} run(s) each")
    report, failures = {}, []
    for dtype in selected_dtypes(args.dtypes):
        job = job_for("offline", dtype, requests, enable_prefix_caching=True, baton_num_kv_blocks=4096)
        results = alternate(job, args.runs, f"offline-{dtype}")
        equal, frac = agreement(results["baton"][0]["token_ids"], results["vllm"][0]["token_ids"])
        report[dtype] = {e: [strip(r) for r in rs] for e, rs in results.items()}
        report[dtype]["agreement"] = {"equal_requests": equal, "of": num, "mean_prefix_fraction": frac}
        print_offline(dtype, results, useful, equal, num, frac)
        if dtype == "float32" and equal != num:
            failures.append(f"float32 outputs differ: {equal}/{num} requests equal")
    print(f"wrote {save('offline', report)}")
    if failures:
        sys.exit("; ".join(failures))


def strip(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "token_ids"}


def print_offline(dtype: str, results: dict[str, list[dict]], useful: int, equal: int, num: int, frac: float) -> None:
    print(f"\n{dtype:9}            time  output tok/s  start-up  load1 before/after  own CPU  others' CPU")
    for label, r in rows(results):
        s = r["elapsed_s"]
        print(
            f"  {label:12} {s:7.2f} s  {useful / s:10.1f}  {r['load_s']:6.1f} s   "
            f"{r['load1_before']:5.2f} / {r['load1_after']:5.2f}     {r['own_cores']:.2f}      {r['others_cores']:.2f} cores"
        )
    print_ratios("time", results, lambda r: r["elapsed_s"])
    b, v = (min(r["elapsed_s"] for r in results[e]) for e in ("baton", "vllm"))
    print(f"  Baton's speed / vLLM's (best runs): {v / b:.2f}x (goal >= 1.3x)")
    print(f"  greedy outputs equal: {equal}/{num} requests; mean agreeing prefix {frac:.1%} of each output")


# -- prefix ------------------------------------------------------------------------------------


def run_prefix(args: argparse.Namespace) -> None:
    import random

    rng = random.Random(1)
    length, shared, num = 1024, 922, 8 if args.quick else 32
    head = [rng.randrange(3, 8192) for _ in range(shared)]

    def tail() -> list[int]:
        return [rng.randrange(3, 8192) for _ in range(length - shared)]

    warm = head + tail()
    from common import BenchRequest

    requests = [BenchRequest(head + tail(), 1) for _ in range(num)]
    job = job_for("burst", "float32", requests, warm=warm, enable_prefix_caching=True, baton_num_kv_blocks=2048)
    print(f"prefix: {num} requests x {length} tokens, {shared} shared, after one warm request; {args.runs} run(s) each")
    results = alternate(job, args.runs, "prefix")
    print("\n                 mean TTFT   p90 TTFT  cached tokens  load1 before/after  own CPU  others' CPU")
    for label, r in rows(results):
        t = sorted(r["ttfts_s"])
        print(
            f"  {label:12} {mean(t) * 1000:8.1f} ms {t[int(0.9 * (len(t) - 1))] * 1000:8.1f} ms"
            f"  {mean(r['cached_tokens']):8.0f}      {r['load1_before']:5.2f} / {r['load1_after']:5.2f}"
            f"     {r['own_cores']:.2f}      {r['others_cores']:.2f} cores"
        )
    print_ratios("mean TTFT", results, lambda r: mean(r["ttfts_s"]))
    print("  goal: Baton / vLLM mean TTFT <= 0.8x")
    print(f"wrote {save('prefix', results)}")
