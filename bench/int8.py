"""int8 against float32: the bench model's decode and prefill, one process.

    python bench/int8.py [--rounds 5] [--threads 2] [--context 256] [--steps 32] [--arms int8,w8a8]
    python bench/int8.py --arms w8a8,w8a8+bf16kv,float32+bf16kv     # a bfloat16 KV cache too

Engines on the same checkpoint, float32 and each arm of --arms: "int8" (weight-only,
services/model/int8_linear.py) and "w8a8" (int8 activations too, per token,
services/model/w8a8_linear.py), either with "+bf16kv" (cache.kv_cache_dtype bfloat16: the
KV cache in bfloat16), and "float32+bf16kv"; prefix caching off so every prompt is computed. Decode step: for batch 1, 2, 4 and 8 with
prompts of --context random tokens, (best time of --steps + 1 greedy tokens - best time of 1
token) / --steps; prefill: one 1024-token prompt and eight 256-token prompts, to their first
token. The arms alternate every round; each arm's best round is its number (others' work on a
shared machine only adds time). The two decode terms take their best rounds apart: the best
of a difference is the round whose first token ran slowest, not a fast round.

Decode MBU = (weight bytes a step reads / step time) / copy bandwidth, where the weight bytes
are every linear layer's and the LM head's (int8 values and scales, or float32), and copy
bandwidth is torch's copy of a 64 MiB and of a 1 GiB float32 buffer (bytes read + bytes
written, per second): on this Xeon the 480 MiB L3 holds the first and not the second, and
the bench model's weights (134 MB float32, 34 MB int8) fit in it.

Agreement: each quantized arm scored on float32's greedy continuations (teacher-forced): the share of
positions where its argmax is float32's token, and the mean |logprob difference| of that
token; and free-running, the share of greedy tokens before the first difference.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from baton.services.engine import LLM, SamplingParams
from baton.services.model.linear import packable_modules
from common import bench_model

BATCHES = (1, 2, 4, 8)


def copy_bandwidth(num_bytes: int, repeats: int = 5) -> float:
    """Bytes read + written per second by torch's copy of a `num_bytes` buffer, best of repeats."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def weight_bytes_per_step(llm: LLM) -> int:
    """Bytes of the linear layers' and the LM head's weights: what one decode step reads."""
    total = 0
    for module in packable_modules(llm.core.executor.rank.runner.model):
        if module.int8 is not None:
            total += module.int8.num_bytes
        else:
            weight = getattr(module, "packed_weight", None)
            weight = module.weight if weight is None else weight
            total += weight.numel() * weight.element_size()
    return total


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - start, outputs


def agreement(reference: LLM, other: LLM, prompts: list[list[int]], num_tokens: int) -> tuple[float, float, float]:
    """(teacher-forced argmax agreement, mean |logprob diff|, free-running share before the first difference)."""
    _, ref_out = timed(reference, prompts, num_tokens)
    _, other_out = timed(other, prompts, num_tokens)
    seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, ref_out, strict=True)]
    score = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    ref_scores, other_scores = reference.generate(seqs, score), other.generate(seqs, score)
    agree, errors, before_difference = [], [], 0
    for prompt, seq, r, o in zip(prompts, seqs, ref_scores, other_scores, strict=True):
        for pos in range(len(prompt), len(seq)):
            agree.append(o.prompt_logprobs[pos][seq[pos]].rank == 1)
            errors.append(abs(o.prompt_logprobs[pos][seq[pos]].logprob - r.prompt_logprobs[pos][seq[pos]].logprob))
    for a, b in zip(ref_out, other_out, strict=True):
        x, y = a.outputs[0].token_ids, b.outputs[0].token_ids
        before_difference += next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x))
    return sum(agree) / len(agree), sum(errors) / len(errors), before_difference / (num_tokens * len(prompts))


def arm_settings(arm: str) -> dict:
    """--arms' names: a quantization (or float32), then "+bf16kv" for a bfloat16 KV cache."""
    weights, _, cache = arm.partition("+")
    if weights not in ("float32", "int8", "w8a8") or cache not in ("", "bf16kv") or arm == "float32":
        raise SystemExit(f"unknown arm {arm!r}: int8, w8a8 or float32+bf16kv, the first two with +bf16kv or not")
    settings = {"kv_cache_dtype": "bfloat16"} if cache else {}
    return settings if weights == "float32" else {**settings, "quantization": weights}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--arms", default="int8,w8a8", help="quantizations to compare with float32")
    args = parser.parse_args()
    arms = [arm for arm in args.arms.split(",") if arm]
    model = str(bench_model())
    common = dict(num_kv_blocks=4096, num_threads=args.threads, enable_prefix_caching=False, dtype="float32")
    engines = {"float32": LLM(model=model, **common)}
    engines.update({arm: LLM(model=model, **arm_settings(arm), **common) for arm in arms})
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(10, 8000) for _ in range(length)] for _ in range(n)]

    for llm in engines.values():
        timed(llm, prompts(8, args.context), 4)  # warm: kernels built, primitives cached
    first_token: dict[tuple[str, int], list[float]] = {}
    all_tokens: dict[tuple[str, int], list[float]] = {}
    prefill: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for batch in BATCHES:
            for name, llm in engines.items():
                first_token.setdefault((name, batch), []).append(timed(llm, prompts(batch, args.context), 1)[0])
                full = timed(llm, prompts(batch, args.context), args.steps + 1)[0]
                all_tokens.setdefault((name, batch), []).append(full)
        for shape, (n, length) in {"1x1024": (1, 1024), "8x256": (8, 256)}.items():
            for name, llm in engines.items():
                prefill.setdefault((name, shape), []).append(timed(llm, prompts(n, length), 1)[0] * 1e3)

    bandwidth = {size: copy_bandwidth(size) for size in (64 * 2**20, 2**30)}
    weights = {name: weight_bytes_per_step(llm) for name, llm in engines.items()}
    print(
        f"bench model, {args.threads} torch threads, context {args.context}, best of {args.rounds} alternating rounds"
    )
    print(
        "copy bandwidth (read + write): "
        + ", ".join(f"{size // 2**20} MiB {bw / 1e9:.1f} GB/s" for size, bw in bandwidth.items())
    )
    print("weight bytes per decode step: " + ", ".join(f"{n} {b / 1e6:.1f} MB" for n, b in weights.items()))
    for batch in BATCHES:
        step = {
            name: (min(all_tokens[name, batch]) - min(first_token[name, batch])) / args.steps * 1e3 for name in engines
        }
        mbu = {
            name: " / ".join(f"{weights[name] / (t / 1e3) / bw:.0%}" for bw in bandwidth.values())
            for name, t in step.items()
        }
        print(
            f"  decode batch {batch}: "
            + ", ".join(f"{name} {t:6.2f} ms" for name, t in step.items())
            + "".join(f"; {arm} {step['float32'] / step[arm]:.2f}x faster" for arm in arms)
            + "; MBU (64 MiB / 1 GiB copy) "
            + ", ".join(f"{name} {m}" for name, m in mbu.items())
        )
    for shape in ("1x1024", "8x256"):
        took = {name: min(prefill[name, shape]) for name in engines}
        print(
            f"  prefill {shape}: "
            + ", ".join(f"{name} {t:7.1f} ms" for name, t in took.items())
            + "".join(f"; {arm} takes {took[arm] / took['float32']:.2f}x" for arm in arms)
        )
    scored = prompts(8, 32)
    for arm in arms:
        agree, error, free = agreement(engines["float32"], engines[arm], scored, 32)
        print(
            f"{arm} agreement (8 prompts x 32 tokens): teacher-forced argmax {agree:.1%}, mean |logprob diff| "
            f"{error:.3f}; free-running greedy tokens before the first difference {free:.1%}"
        )


if __name__ == "__main__":
    main()
