"""Rollout throughput: n samples per prompt in one request (the prompt prefilled once, its
blocks shared by the samples) against the same samples as n separate requests.

    python bench/rollout.py [--prompts 8] [--n 8] [--prompt-len 512] [--output-len 64]

The bench model (float32, CPU), one offline `LLM` with prefix caching off (so the separate
requests cannot share the prompt through the cache either: the baseline an RL loop without
n > 1 gets), temperature 1 with seeds. Alternates the two arms, best of --reps, prints
samples/s and the ratio.
"""

from __future__ import annotations

import argparse
import time

from baton.services.engine import LLM, SamplingParams
from common import bench_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    llm = LLM(model=str(bench_model()), enable_prefix_caching=False, max_model_len=2048, num_threads=2)
    vocab = llm.core.arch.vocab_size
    prompts = [[(7 * i + 13 * j) % (vocab - 1) + 1 for j in range(args.prompt_len)] for i in range(args.prompts)]
    base = dict(max_tokens=args.output_len, temperature=1.0, ignore_eos=True)

    def shared() -> int:
        outputs = llm.generate(prompts, [SamplingParams(n=args.n, seed=i, **base) for i in range(len(prompts))])
        return sum(len(o.outputs) for o in outputs)

    def separate() -> int:
        many = [p for p in prompts for _ in range(args.n)]
        params = [SamplingParams(seed=1000 * i + k, **base) for i in range(len(prompts)) for k in range(args.n)]
        return len(llm.generate(many, params))

    shared()  # warm-up
    best = {"n samples per request": 0.0, "n separate requests": 0.0}
    for _ in range(args.reps):
        for name, arm in (("n samples per request", shared), ("n separate requests", separate)):
            start = time.perf_counter()
            samples = arm()
            best[name] = max(best[name], samples / (time.perf_counter() - start))
    for name, rate in best.items():
        print(f"{name:<24} {rate:8.2f} samples/s")
    ratio = best["n samples per request"] / best["n separate requests"]
    print(
        f"n={args.n} per request / separate: {ratio:.2f}x "
        f"({args.prompts} prompts of {args.prompt_len} tokens, {args.output_len} tokens each)"
    )


if __name__ == "__main__":
    main()
