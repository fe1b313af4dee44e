"""Engine benchmarks (CPU, float32), each against a baseline measured in the same run.

throughput  Baton vs Hugging Face `generate` with padded static batches: the same 64
            requests with mixed prompt and output lengths; output tokens/s and the ratio.
prefix      32 requests sharing a 90% prefix, arriving together: mean TTFT with prefix
            caching vs without.
chunked     a decode-heavy batch plus one long prompt: decode TPOT p99 with chunked
            prefill vs without.
async       16 streams (128 -> 256 tokens) through AsyncLLM, whose engine thread runs the
            step loop beside the caller's event loop (what a serving replica does), vs the
            same requests through LLM.generate in static batches of 16: output tokens/s.

  python bench/engine.py [throughput|prefix|chunked|async|all] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import time

import torch
from baton.services.engine import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from baton.services.engine.config import EngineConfig
from baton.services.engine.engine_core import EngineCore
from baton.services.model.linear import linear, pack_weight_for_cpu
from common import BenchRequest, bench_model, mixed_workload, num_params, percentile


def run_baton(model_dir, requests: list[BenchRequest], **engine_kwargs) -> float:
    llm = LLM(model=str(model_dir), **engine_kwargs)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests]
    llm.generate([requests[0].prompt_token_ids], SamplingParams(max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params)
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == [r.max_tokens for r in requests]
    return elapsed


def run_hf(model_dir, requests: list[BenchRequest], batch_size: int, onednn: bool = False) -> float:
    """Static batches in arrival order, left-padded; each batch runs to its longest output.
    `onednn`: every nn.Linear multiplies by a oneDNN-packed weight, as Baton's do on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if onednn:
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                packed = pack_weight_for_cpu(module.weight)
                module.forward = lambda x, packed=packed, bias=module.bias: linear(x, packed, bias)
    pad = model.generation_config.pad_token_id or 0
    start = time.perf_counter()
    for begin in range(0, len(requests), batch_size):
        batch = requests[begin : begin + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids) :] = 1
        longest = max(r.max_tokens for r in batch)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False)
    return time.perf_counter() - start


def bench_throughput(quick: bool) -> None:
    model_dir = bench_model()
    num = 16 if quick else 64
    requests = mixed_workload(num, (16, 512), (16, 256), vocab_size=8192, seed=0)
    useful = sum(r.max_tokens for r in requests)
    print(
        f"model: random Llama, {num_params(model_dir) / 1e6:.1f}M parameters, float32, {torch.get_num_threads()} threads"
    )
    print(f"workload: {num} requests, prompts 16-512 tokens, outputs 16-256 tokens ({useful} output tokens)")
    baton_s = run_baton(model_dir, requests, num_kv_blocks=4096, max_num_seqs=64, max_num_batched_tokens=2048)
    print(f"baton            {baton_s:7.2f} s  {useful / baton_s:8.1f} output tok/s")
    best = None
    for batch_size in (8, 16, 64) if not quick else (16,):
        hf_s = run_hf(model_dir, requests, batch_size)
        print(f"hf generate b={batch_size:<3} {hf_s:7.2f} s  {useful / hf_s:8.1f} output tok/s")
        best = hf_s if best is None else min(best, hf_s)
    print(f"ratio baton / best hf: {best / baton_s:.2f}x (goal >= 4x)")
    # Not the goal's baseline (stock HF is); it shows what is left once HF multiplies with
    # the same oneDNN GEMMs: batching, paging and attention.
    hf_onednn_s = run_hf(model_dir, requests, 64 if not quick else 16, onednn=True)
    print(f"hf generate b={64 if not quick else 16:<3} with Baton's oneDNN linears {hf_onednn_s:7.2f} s  "
          f"{useful / hf_onednn_s:8.1f} output tok/s; ratio {hf_onednn_s / baton_s:.2f}x")  # fmt: skip


def ttft_of_burst(model_dir, prompts: list[list[int]], prefix_caching: bool) -> float:
    """Mean time to first token of requests that all arrive at once (cache warmed by one)."""
    config = EngineConfig.from_kwargs(
        model=str(model_dir),
        num_kv_blocks=2048,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        enable_prefix_caching=prefix_caching,
    )
    engine = EngineCore(config)
    params = SamplingParams(max_tokens=1, temperature=0)
    engine.add_request("warm", prompts[0], params)  # one earlier request holding the shared prefix
    while engine.has_unfinished_requests():
        engine.step()
    arrival = time.monotonic()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params, arrival_time=arrival)
    ttfts = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ttfts.append(out.metrics.first_token_time - arrival)
    return sum(ttfts) / len(ttfts)


def bench_prefix(quick: bool) -> None:
    import random

    model_dir = bench_model()
    rng = random.Random(1)
    length, shared = 1024, 922  # 90% shared
    prefix = [rng.randrange(3, 8192) for _ in range(shared)]
    prompts = [prefix + [rng.randrange(3, 8192) for _ in range(length - shared)] for _ in range(8 if quick else 32)]
    off = ttft_of_burst(model_dir, prompts, prefix_caching=False)
    on = ttft_of_burst(model_dir, prompts, prefix_caching=True)
    print(f"shared-prefix burst: {len(prompts)} requests x {length} tokens, {shared} shared (90%)")
    print(f"mean TTFT without prefix caching {off * 1000:8.1f} ms")
    print(f"mean TTFT with prefix caching    {on * 1000:8.1f} ms")
    print(f"ratio: {on / off:.3f}x (goal <= 0.2x)")


def decode_itls(model_dir, chunked: bool, long_prompt: int) -> list[float]:
    """Inter-token latencies of 16 decoding requests while one long prompt arrives."""
    budget = 256 if chunked else long_prompt + 64
    config = EngineConfig.from_kwargs(
        model=str(model_dir),
        num_kv_blocks=2048,
        max_num_seqs=64,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=False,
    )
    engine = EngineCore(config)
    decode = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    for i in range(16):
        engine.add_request(f"d{i}", [5 + i] * 32, decode)
    last: dict[str, float] = {}
    itls: list[float] = []
    step = 0
    while engine.has_unfinished_requests():
        if step == 10:
            engine.add_request("long", list(range(10, 10 + long_prompt)), SamplingParams(max_tokens=1, temperature=0))
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id.startswith("d") and out.token_ids:
                if out.request_id in last:
                    itls.append(now - last[out.request_id])
                last[out.request_id] = now
        step += 1
    return itls


def bench_chunked(quick: bool) -> None:
    model_dir = bench_model()
    long_prompt = 1024 if quick else 3072
    without = decode_itls(model_dir, chunked=False, long_prompt=long_prompt)
    with_chunks = decode_itls(model_dir, chunked=True, long_prompt=long_prompt)
    print(f"16 decoding requests + one {long_prompt}-token prompt arriving mid-decode")
    for name, itls in (("without chunked prefill", without), ("with chunked prefill   ", with_chunks)):
        print(
            f"{name}: TPOT p50 {percentile(itls, 50) * 1000:7.1f} ms  p99 {percentile(itls, 99) * 1000:7.1f} ms"
            f"  max {max(itls) * 1000:7.1f} ms"
        )
    print(f"p99 ratio chunked / unchunked: {percentile(with_chunks, 99) / percentile(without, 99):.2f}x")


def async_run(mode: str, quick: bool) -> float:
    """One mode of `bench_async` in this (fresh) process: output tokens/s."""
    model_dir, concurrency = str(bench_model()), 16
    rng = random.Random(0)
    num = 16 if quick else 48
    prompts = [[rng.randrange(10, 8000) for _ in range(128)] for _ in range(num)]
    params = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
    kwargs = dict(num_kv_blocks=16384, max_num_seqs=64, max_model_len=2048, num_threads=2)
    if mode == "offline":
        llm = LLM(model=model_dir, **kwargs)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2))
        start = time.perf_counter()
        for i in range(0, num, concurrency):
            llm.generate(prompts[i : i + concurrency], params)
        return num * 256 / (time.perf_counter() - start)

    async def streams() -> float:
        config = EngineConfig.from_kwargs(model=model_dir, **kwargs)
        # The ablation builds the core here, on the caller's thread, as replicas did before
        # the engine thread built its own: two OpenMP teams (model/cpu_tuning.py).
        engine = AsyncLLM(config, core=EngineCore(config)) if mode == "ablation" else AsyncLLM(config)
        async for _ in engine.generate("warm", prompts[0], SamplingParams(max_tokens=2)):
            pass
        queue = list(range(num))

        async def client() -> None:
            while queue:
                i = queue.pop()
                async for _ in engine.generate(f"r{i}", prompts[i], params):
                    pass

        start = time.perf_counter()
        await asyncio.gather(*[client() for _ in range(concurrency)])
        elapsed = time.perf_counter() - start
        engine.shutdown()
        return num * 256 / elapsed

    return asyncio.run(streams())


def bench_async(quick: bool) -> None:
    """Each run in a fresh process: a thread that has run torch keeps its OpenMP team for
    the process's life, so modes sharing a process would measure each other."""
    runs = 1 if quick else 3
    results: dict[str, list[float]] = {"offline": [], "streams": [], "ablation": []}
    for _ in range(runs):  # alternating; each mode's best run is its headline (noise only adds time)
        for mode in results:
            cmd = [sys.executable, __file__, "_async", mode, *(["--quick"] if quick else [])]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            results[mode].append(float(out.strip().splitlines()[-1]))
    best = {mode: max(values) for mode, values in results.items()}
    print(f"16 streams of 128 -> 256 tokens, 2 torch threads; best of {runs} runs, each in its own process")
    print("  runs: " + ", ".join(f"{m} {[round(x) for x in v]}" for m, v in results.items()))
    print(f"LLM.generate, static batches of 16:              {best['offline']:7.1f} tok/s")
    print(
        f"AsyncLLM, 16 streams:                            {best['streams']:7.1f} tok/s  ({best['streams'] / best['offline']:.2f}x)"
    )
    print(
        f"  ablation: its core built on the caller thread  {best['ablation']:7.1f} tok/s"
        f"  ({best['ablation'] / best['offline']:.2f}x)"
    )


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "_async":
        print(async_run(sys.argv[2], "--quick" in sys.argv))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", nargs="?", default="all", choices=["throughput", "prefix", "chunked", "async", "all"])
    parser.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    args = parser.parse_args()
    benches = (("throughput", bench_throughput), ("prefix", bench_prefix), ("chunked", bench_chunked))
    for name, fn in (*benches, ("async", bench_async)):
        if args.which in (name, "all"):
            print(f"== {name}")
            fn(args.quick)


if __name__ == "__main__":
    main()
