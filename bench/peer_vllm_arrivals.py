"""The serving loads without the servers: Baton's engine vs vLLM's under Poisson arrivals.

    python bench/peer_vllm.py arrivals [--quick] [--runs N]

The random 256 -> 128 loads of `python bench/peer_vllm.py serving` (1 and 3 requests a
second) go straight to each engine's asynchronous front end, in a fresh process per run:
Baton's AsyncLLM (its engine loop on a thread of its own, as in a replica) and vLLM's
AsyncLLM (its engine core in a process of its own, as `vllm serve` runs it). There is no
HTTP, no tokenizer and no Ray, so the difference between these ratios and the serving ones
is what each server adds around its engine. Both get the same prompts (random token ids)
and the same arrival times, a 16-request warm-up, and are timed by the same function
(peer_vllm_worker.timed_arrivals: TTFT from submission to the first token, TPOT over the
rest). float32, prefix caching on, bench/peer_vllm.py's engine limits, vLLM's documented
CPU environment on both cores; the engines alternate, and a run during which the rest of
the machine was busy is repeated. Results go to .baton/peer-vllm/arrivals-TIME.json.
"""

from __future__ import annotations

import argparse
import random
from statistics import median

from common import BenchRequest
from peer_vllm import ENGINE_LIMITS, QUIET_CORES, alternate, job_for, print_ratios, rows, save

INPUT_LEN, OUTPUT_LEN = 256, 128
# (rate, requests in a full run, in a quick one, seed): the serving loads' rates and counts
LOADS = ((1.0, 60, 12, 11), (3.0, 90, 12, 100))


def requests_for(rate: float, num: int, seed: int) -> tuple[list[BenchRequest], list[float], list[list[int]]]:
    """Random prompts, their Poisson arrival offsets, and the warm-up's prompts."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 8192) for _ in range(INPUT_LEN)] for _ in range(num)]
    offsets, at = [], 0.0
    for _ in range(num):
        at += rng.expovariate(rate)
        offsets.append(at)
    warm = [[rng.randrange(3, 8192) for _ in range(128)] for _ in range(16)]
    return [BenchRequest(p, OUTPUT_LEN) for p in prompts], offsets, warm


def baton_job(job: dict) -> dict:
    """The Baton side, in this process."""
    import asyncio

    from baton.services.engine import AsyncLLM, RequestOutputKind, SamplingParams
    from baton.services.engine.config import EngineConfig
    from peer_vllm_worker import timed_arrivals, warm_up

    config = EngineConfig.from_kwargs(
        model=job["model"],
        dtype=job["dtype"],
        num_kv_blocks=job["baton_num_kv_blocks"],
        enable_prefix_caching=True,
        **ENGINE_LIMITS,
    )

    async def main() -> dict:
        engine = AsyncLLM(config)

        async def stream(request_id: str, token_ids: list[int], max_tokens: int):
            params = SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
            )
            async for out in engine.generate(request_id, token_ids, params):
                yield len(out.token_ids)

        try:
            await warm_up(stream, job["warm"])
            return await timed_arrivals(stream, job["requests"])
        finally:
            engine.shutdown()

    return {**asyncio.run(main()), "engine": "baton"}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def out_tok_s(r: dict) -> float:
    return sum(r["tokens"]) / r["elapsed_s"]


def run_arrivals(args: argparse.Namespace) -> None:
    saved = {}
    for rate, full, quick, seed in LOADS:
        num = quick if args.quick else full
        requests, offsets, warm = requests_for(rate, num, seed)
        job = job_for("arrivals", "float32", requests, warm=warm, baton_num_kv_blocks=16384)
        for request, at_s in zip(job["requests"], offsets):
            request["at_s"] = at_s
        tag = f"arrivals-{rate:g}"
        print(
            f"{tag}: {num} requests of {INPUT_LEN} -> {OUTPUT_LEN} tokens, Poisson {rate:g}/s; {args.runs} run(s) each"
        )
        results = alternate(job, args.runs, tag)
        bad = [r["engine"] for r in results["baton"] + results["vllm"] if set(r["tokens"]) != {OUTPUT_LEN}]
        print("\n               out tok/s  TTFT p50 / p90 ms   TPOT p50 / p90 ms   own CPU  others' CPU")
        for label, r in rows(results):
            t, p = [x * 1000 for x in r["ttft_s"]], [x * 1000 for x in r["tpot_s"]]
            print(
                f"  {label:12} {out_tok_s(r):7.1f}   {median(t):7.0f} / {pct(t, 90):6.0f}"
                f"     {median(p):6.1f} / {pct(p, 90):6.1f}     {r['own_cores']:.2f}      {r['others_cores']:.2f} cores"
            )

        print_ratios("seconds per output token", results, lambda r: 1 / out_tok_s(r))
        print_ratios("TTFT p90", results, lambda r: pct(r["ttft_s"], 90))
        print_ratios("TPOT p50", results, lambda r: median(r["tpot_s"]))
        print_ratios("TPOT p90", results, lambda r: pct(r["tpot_s"], 90))
        if bad:
            raise SystemExit(f"{tag}: runs of {sorted(set(bad))} did not stream {OUTPUT_LEN} tokens per request")
        saved[tag] = results
    print(f"  (a run is quiet when the rest of the machine used < {QUIET_CORES} cores)")
    print(f"wrote {save('arrivals', saved)}")
