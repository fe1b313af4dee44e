"""Baton's CPU kernels against what they replaced, in one process, on the bench model's shapes.

    python bench/cpu_kernels.py linear [--dtype float32|bfloat16]   # blocked linear vs what `linear` runs without it
    python bench/cpu_kernels.py decode [--dtype float32|bfloat16]   # the engine's decode step, both ways
    python bench/cpu_kernels.py prefill                             # prefill attention vs the reference
    python bench/cpu_kernels.py int8                                # the int8 and w8a8 linears vs the float32 one

linear   every linear shape of the bench model (and its LM head) at 1-2,048 rows: the blocked
         kernel (kernels/csrc/cpu_blocked_linear.cpp) and oneDNN's packed GEMM on the same
         weights (torch's dense matmul where oneDNN has no kernel for the dtype: bfloat16
         without AVX-512), enough copies of each weight (~150 MB) that they are read from
         memory as in a decode step (two from 256 rows, where the multiply is compute-bound);
         best of 5; time ratio blocked / baseline per shape and summed over shapes.
decode   two engines on the bench model, one with blocked weights, one with what `linear`
         runs without them (oneDNN's packed weights, or torch's matmul as above),
         alternating; decode step time at batch 1-32 (256-token prompts; the time of 48
         greedy tokens less that of 1, per token); best of 3.
prefill  causal prefill attention (8 query / 4 KV heads of 64, float32) over the paged cache, of
         one prompt and of a prefix-cached step (18 requests' 112 new tokens after 912 cached):
         the C++ kernel (kernels/csrc/cpu_paged_prefill_attention.cpp) against
         `prefill_attention_ref` (gather + torch's flash attention), which the CPU ran before.
int8     the bench model's layer shapes at 1-32 rows and 256: the weight-only int8 linear
         (kernels/csrc/cpu_int8_linear.cpp) and the w8a8 one (cpu_w8a8_linear.cpp, int8
         activations) against the blocked float32 one, weights read from memory as in
         `linear`; time ratios float32 / int8 and float32 / w8a8 summed over the shapes.

Each prints the baseline it measured and the ratio. 2 torch threads unless --threads.
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
from collections.abc import Callable
from functools import partial

import torch
from baton.kernels import cpu_ops
from baton.kernels.reference import prefill_attention_ref
from baton.services.model import blocked_linear, embedding, linear
from baton.services.model.blocked_linear import pack_blocks
from baton.services.model.int8_linear import Int8Weight
from baton.services.model.w8a8_linear import W8A8Weight
from common import bench_model

# (N, K) of the bench model: qkv, o, gate_up, down, LM head
SHAPES = ((1024, 512), (512, 512), (3072, 512), (512, 1536), (8192, 512))
ROWS = (1, 2, 4, 8, 16, 32, 64, 256, 2048)
INT8_ROWS = (1, 2, 4, 8, 16, 32, 256)  # decode batches, and a prefill chunk
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def best_of(fn: Callable[[], None], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _baseline(dtype: torch.dtype) -> str:
    """What `linear` runs without the blocked kernel: oneDNN's packed GEMM where oneDNN
    multiplies the dtype natively, else torch's dense matmul (bfloat16 without AVX-512)."""
    return "oneDNN" if linear.pack_weight_for_cpu(torch.ones(16, 16, dtype=dtype)) is not None else "torch"


def bench_linear(dtype: torch.dtype) -> None:
    if not torch.ops.baton_cpu.blocked_linear_supported(dtype):
        raise SystemExit(f"this CPU's build has no blocked linear kernel for {dtype}")
    baseline = _baseline(dtype)
    totals: dict[int, list[float]] = {}
    print(f"blocked linear vs {baseline}, {dtype}, {torch.get_num_threads()} threads (us per call, best of 5)")
    for n, k in SHAPES:
        copies = max(1, int(150e6 / (n * k * dtype.itemsize)))
        weights = [torch.randn(n, k).to(dtype) for _ in range(copies)]
        packed = [linear.pack_weight_for_cpu(w) if baseline == "oneDNN" else w for w in weights]
        blocks = [pack_blocks(w) for w in weights]
        print(f"  {n} x {k}")
        for rows in ROWS:
            x = torch.randn(rows, k).to(dtype)
            # From 256 rows the multiply is compute-bound and reuses its weights anyway: two copies do.
            use = len(weights) if rows < 256 else min(2, len(weights))

            def run_baseline(x=x, packed=packed[:use]) -> None:
                for w in packed:
                    linear.linear(x, w)

            def run_blocked(x=x, blocks=blocks[:use], n=n) -> None:
                for b in blocks:
                    torch.ops.baton_cpu.blocked_linear(x, b, None, n)

            run_baseline(), run_blocked()  # warm: oneDNN builds its primitive
            a, b = best_of(run_baseline, 5) / use, best_of(run_blocked, 5) / use
            totals.setdefault(rows, [0.0, 0.0])
            totals[rows][0] += a
            totals[rows][1] += b
            print(f"    {rows:5} rows: {baseline} {a * 1e6:8.0f}  blocked {b * 1e6:8.0f}  ratio {b / a:.2f}")
    print(
        f"summed over the shapes, blocked / {baseline} time: "
        + ", ".join(f"{r}: {b / a:.2f}" for r, (a, b) in totals.items())
    )


def bench_int8() -> None:
    if not torch.ops.baton_cpu.blocked_linear_supported(torch.float32):
        raise SystemExit("this CPU's build has no blocked float32 linear to compare with")
    if not torch.ops.baton_cpu.w8a8_linear_fast():
        print("(this build's w8a8 kernel is the scalar one)")
    totals: dict[int, list[float]] = {}
    print(f"int8 and w8a8 linears vs blocked float32, {torch.get_num_threads()} threads (us per call, best of 5)")
    for n, k in SHAPES[:-1]:  # the layers; the LM head stays as in `linear`
        copies = max(1, int(150e6 / (n * k * 4)))
        weights = [torch.randn(n, k) * 0.1 for _ in range(copies)]
        int8 = [Int8Weight.from_float(w, "cpp") for w in weights]
        w8a8 = [W8A8Weight.from_float(w, "cpp") for w in weights]
        blocks = [pack_blocks(w) for w in weights]
        for rows in INT8_ROWS:
            x = torch.randn(rows, k)
            # From 256 rows the multiply is compute-bound and reuses its weights anyway: two copies do.
            use = copies if rows < 256 else min(2, copies)

            def run_quantized(x=x, quantized=None) -> None:
                for w in quantized:
                    w(x)

            def run_float32(x=x, blocks=blocks[:use], n=n) -> None:
                for b in blocks:
                    torch.ops.baton_cpu.blocked_linear(x, b, None, n)

            arms = (
                run_float32,
                partial(run_quantized, quantized=int8[:use]),
                partial(run_quantized, quantized=w8a8[:use]),
            )
            for arm in arms:
                arm()  # warm
            times = [best_of(arm, 5) / use for arm in arms]
            totals[rows] = [a + b for a, b in zip(totals.get(rows, [0.0] * 3), times)]
    for rows, (a, b, c) in totals.items():
        print(
            f"  {rows:4} rows: float32 {a * 1e6:7.0f}  int8 {b * 1e6:7.0f}  w8a8 {c * 1e6:7.0f}"
            f"  float32 / int8 {a / b:.2f}  float32 / w8a8 {a / c:.2f}"
        )


def _engine(dtype: str, blocked: bool):
    from baton.services.engine import LLM

    real = blocked_linear.uses_blocked_kernel
    choice = real if blocked else (lambda weight, impl: False)
    linear.uses_blocked_kernel = embedding.uses_blocked_kernel = choice  # read at load (process_weights_after_loading)
    try:
        return LLM(model=str(bench_model()), num_kv_blocks=4096, dtype=dtype)
    finally:
        linear.uses_blocked_kernel = embedding.uses_blocked_kernel = real


def bench_decode(dtype: str, rounds: int) -> None:
    from baton.services.engine import SamplingParams

    baseline = _baseline(DTYPES[dtype])
    engines = {baseline: _engine(dtype, blocked=False), "blocked": _engine(dtype, blocked=True)}
    rng = random.Random(0)
    batches = (1, 2, 4, 8, 16, 32)
    prompts = {b: [[rng.randrange(10, 8000) for _ in range(256)] for _ in range(b)] for b in batches}
    steps, times = 48, {}
    for _ in range(rounds):
        for batch in batches:
            for name, llm in engines.items():
                greedy = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
                one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
                llm.generate(prompts[batch], SamplingParams(max_tokens=2))
                full = best_of(lambda llm=llm, b=batch, g=greedy: llm.generate(prompts[b], g), 1)
                first = best_of(lambda llm=llm, b=batch, o=one: llm.generate(prompts[b], o), 1)
                key = (name, batch)
                times[key] = min(times.get(key, float("inf")), (full - first) / (steps - 1))
    print(f"decode step, bench model, {dtype}, {torch.get_num_threads()} threads, best of {rounds} alternating rounds")
    for batch in batches:
        a, b = times[baseline, batch], times["blocked", batch]
        print(f"  batch {batch:2}: {baseline} {a * 1e3:6.2f} ms, blocked {b * 1e3:6.2f} ms: {b / a:.2f}x")


def bench_prefill() -> None:
    if not cpu_ops.prefill_attention_supported(8, 4, 64):
        raise SystemExit("this CPU's build has no prefill attention kernel")
    print(f"prefill attention, 8/4 heads of 64, float32, {torch.get_num_threads()} threads")
    gen = torch.Generator().manual_seed(0)
    # (cached, new) tokens per request: one prompt of each length, and the first step of
    # bench/peer_vllm.py prefix (18 requests' 112 new tokens after 912 cached)
    cases = {f"one prompt of {n}": [(0, n)] for n in (264, 512, 1024, 2048)}
    cases["prefix-cached step"] = [(912, 112)] * 18
    for name, requests in cases.items():
        blocks_per_request = max(c + n for c, n in requests) // 16 + 1
        num_blocks = blocks_per_request * len(requests)
        key_cache, value_cache = (torch.randn(num_blocks, 16, 4, 64, generator=gen) for _ in range(2))
        table = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(len(requests), blocks_per_request)
        num_new = [n for _, n in requests]
        query = torch.randn(sum(num_new), 8, 64, generator=gen)
        starts = torch.tensor([0, *itertools.accumulate(num_new)], dtype=torch.int32)
        lens = torch.tensor([c + n for c, n in requests], dtype=torch.int32)
        args = (query, key_cache, value_cache, table.contiguous(), starts, lens, 0.125)
        kernel = best_of(lambda a=args: cpu_ops.paged_prefill_attention(*a), 10)
        ref = best_of(lambda a=args: prefill_attention_ref(*a), 10)
        # each query token sees its cached context and the new tokens up to itself
        flops = sum(8 * 64 * 4 * (c + i + 1) for c, n in requests for i in range(n))
        print(
            f"  {name:20}: reference {ref * 1e3:7.2f} ms ({flops / ref / 1e9:4.0f} GFLOP/s), "
            f"kernel {kernel * 1e3:7.2f} ms ({flops / kernel / 1e9:4.0f} GFLOP/s): {kernel / ref:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=["linear", "decode", "prefill", "int8"])
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu_ops.require()
    if args.which == "linear":
        bench_linear(DTYPES[args.dtype])
    elif args.which == "decode":
        bench_decode(args.dtype, args.rounds)
    elif args.which == "int8":
        bench_int8()
    else:
        bench_prefill()


if __name__ == "__main__":
    main()
