"""Fused CPU kernels on and off: the bench model's decode step time, the same engine in one process.

    python bench/fused_kernels.py [--rounds 5] [--threads 2]

"Off" routes the two fused ops (RMSNorm with the residual add; rotary embedding with the
KV-cache write, kernels/csrc/cpu_fused_ops.cpp) to their torch references, which is what the
engine ran before them; decode attention keeps its C++ kernel in both arms. For batch sizes
1, 4 and 16 (16-token prompts, 48 greedy tokens), the arms alternate every round; each arm's
best round is its number (others' work on a shared machine only adds time). Prints ms per
step, the on / off ratio, and how far greedy outputs agree (float32 sums in another order
can flip a near-tied argmax of the random bench model; the kernels' own tests bound the
differences).
"""

from __future__ import annotations

import argparse
import random
import time

from baton.kernels import cpu_ops, reference
from baton.services.engine import LLM, SamplingParams
from common import bench_model

FUSED = {"rms_norm": cpu_ops.rms_norm, "rotary_embedding_and_cache": cpu_ops.rotary_embedding_and_cache}


def _rope_then_cache(positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping) -> None:
    reference.rotary_embedding_ref(positions, query, key, cos_sin_cache)
    reference.reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping)


REFERENCES = {"rms_norm": reference.rms_norm_ref, "rotary_embedding_and_cache": _rope_then_cache}


def use_fused(on: bool) -> None:
    for name, fn in (FUSED if on else REFERENCES).items():
        setattr(cpu_ops, name, fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(model=str(bench_model()), num_kv_blocks=4096, num_threads=args.threads)
    rng = random.Random(0)
    steps = 48
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    times: dict[tuple[int, bool], list[float]] = {}
    agree = [0, 0]  # greedy tokens before the first difference, of all tokens
    for _ in range(args.rounds):
        for batch in (1, 4, 16):
            prompts = [[rng.randrange(10, 8000) for _ in range(16)] for _ in range(batch)]
            tokens = {}
            for on in (False, True):
                use_fused(on)
                llm.generate(prompts, SamplingParams(max_tokens=4))  # warm
                start = time.perf_counter()
                outputs = llm.generate(prompts, params)
                times.setdefault((batch, on), []).append((time.perf_counter() - start) / steps * 1e3)
                tokens[on] = [o.token_ids for o in outputs]
            for fused, ref in zip(tokens[True], tokens[False], strict=True):
                agree[0] += next((i for i, (a, b) in enumerate(zip(fused, ref)) if a != b), len(ref))
                agree[1] += len(ref)
    use_fused(True)
    print(f"decode step, bench model, {args.threads} torch threads, best of {args.rounds} alternating rounds")
    for batch in (1, 4, 16):
        off, on = min(times[batch, False]), min(times[batch, True])
        print(f"  batch {batch:2d}: references {off:6.2f} ms, fused {on:6.2f} ms: {on / off:.3f}x")
    print(f"greedy outputs agree on {agree[0] / agree[1]:.1%} of their tokens before any difference")


if __name__ == "__main__":
    main()
