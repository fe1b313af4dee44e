"""Tensor parallelism on CPU: step time with TP=1 vs TP=2, and the share of each TP=2 step
spent in all-reduce / all-gather (gloo), same model and requests in one run.

On two cores TP=2 is expected to be slower (each rank gets one core and the collectives
add latency); the point is to record the communication overhead per step.

    python bench/tensor_parallel.py [--requests 16] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from baton.services.engine import LLM, SamplingParams
from baton.services.ray_env import import_ray
from common import bench_model, mixed_workload


def run(model_dir, tp: int, requests) -> tuple[float, int, float]:
    llm = LLM(
        model=str(model_dir), tensor_parallel_size=tp, num_kv_blocks=1024, max_num_seqs=16, max_num_batched_tokens=512
    )
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests]
    llm.generate([requests[0].prompt_token_ids], SamplingParams(max_tokens=2))  # warm-up
    executor = llm.core.executor
    if tp > 1:
        ray = import_ray()
        ray.get([w.collective_stats.remote() for w in executor.ranks])  # reset
    steps_before = len(llm.core.step_window.steps)
    start = time.perf_counter()
    llm.generate([r.prompt_token_ids for r in requests], params)
    elapsed = time.perf_counter() - start
    steps = len(llm.core.step_window.steps) - steps_before
    collective = 0.0
    if tp > 1:
        per_rank = ray.get([w.collective_stats.remote() for w in executor.ranks])
        collective = max(seconds for seconds, _ in per_rank)
    llm.shutdown()
    return elapsed, steps, collective


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    model_dir = bench_model()
    requests = mixed_workload(args.requests, (32, 256), (args.max_tokens, args.max_tokens), 8192, seed=3)
    ray = import_ray()
    ray.init(
        num_cpus=2, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="ray-", dir="/tmp"), log_to_driver=False
    )
    one, steps_one, _ = run(model_dir, 1, requests)
    two, steps_two, collective = run(model_dir, 2, requests)
    ray.shutdown()
    print(f"{args.requests} requests, prompts 32-256 tokens, {args.max_tokens} output tokens each, bench model fp32")
    print(f"TP=1: {one:6.2f} s, {steps_one} steps, {one / steps_one * 1000:6.1f} ms/step")
    print(
        f"TP=2: {two:6.2f} s, {steps_two} steps, {two / steps_two * 1000:6.1f} ms/step "
        f"(collectives {collective / steps_two * 1000:5.1f} ms/step = {collective / two:.0%} of the time)"
    )
    print(f"step time ratio TP=2 / TP=1: {(two / steps_two) / (one / steps_one):.2f}x")


if __name__ == "__main__":
    main()
