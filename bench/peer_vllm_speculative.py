"""Speculative decoding, Baton vs vLLM's CPU build (issue 20's peer comparison).

    python bench/peer_vllm.py speculative [--quick] [--runs N]

The workloads are bench/speculative.py's own (the same model folders, prompts and greedy
requests, built by its `workloads`):

  cycle        the cycle model, n-gram drafts: after one lap of its 32-token cycles every
               draft is right (acceptance near 1).
  random       the bench model, n-gram drafts: its greedy output never repeats, nothing is
               drafted (the cost of looking).
  draft-cycle  the cycle model drafted by a one-layer copy of itself (method draft_model).

n-gram: k = 3, prompt lookups of 2..5 tokens (vLLM: speculative_config={"method": "ngram",
"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}); draft model:
{"method": "draft_model", "model": DIR, "num_speculative_tokens": 3}. Per workload and run,
four fresh processes: Baton plain, vLLM plain, Baton speculative, vLLM speculative (the
engine order flips every other run), each loading its engine, warming up, then timing the
prompts at concurrency 1 (one at a time) and 8 (all at once) with the same stepping loop
(peer_vllm_worker.timed_decode): TPOT = (finish - first token) / (tokens after the first),
both taken when the engine's step returns them, averaged over requests; the headline is
each mode's fastest run. float32, prefix caching off, bench/peer_vllm.py's engine limits
and vLLM's documented CPU environment on both cores. Greedy speculative outputs must equal
plain ones within each engine (checked; a difference fails the run after the report);
Baton's and vLLM's tokens are compared and the agreement printed. Acceptance (accepted /
draft tokens) and mean acceptance length (1 + accepted / drafts) come from each engine's own
counters: Baton's speculator stats, vLLM's vllm:spec_decode_* Prometheus counters
(LLM.get_metrics, stats on). A configuration vLLM refuses is reported with its message.
Results go to .baton/peer-vllm/speculative-TIME.json.
"""

from __future__ import annotations

import argparse
import sys

from peer_vllm import ENGINE_LIMITS, OUT, QUIET_CORES, agreement, load1, run_engine, save, wait_quiet
from speculative import Workload, workloads

NAMES = ("cycle", "random", "draft-cycle")
CONCURRENCIES = (1, 8)
MODES = ("plain", "spec")


def vllm_config(workload: Workload, k: int) -> dict:
    if workload.draft is not None:
        return {"method": "draft_model", "model": str(workload.draft), "num_speculative_tokens": k}
    lo, hi = workload.lookup
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}


def job_for(workload: Workload, k: int, speculative: bool) -> dict:
    return {
        "kind": "speculative",
        "model": str(workload.model),
        "prompts": workload.prompts,
        "max_tokens": workload.params.max_tokens,
        "concurrencies": list(CONCURRENCIES),
        "limits": ENGINE_LIMITS,
        "speculative": vllm_config(workload, k) if speculative else None,
    }


# -- the Baton side (a fresh process: bench/peer_vllm.py _baton-job IN OUT) ---------------------


def baton_job(job: dict) -> dict:
    """As peer_vllm_worker.speculative, on Baton's engine; vLLM's speculative_config mapped
    onto Baton's settings of the same names."""
    import time

    from baton.services.engine import LLM, SamplingParams
    from peer_vllm_worker import timed_decode

    spec = job["speculative"]
    settings = {}
    if spec is not None:
        settings = {"speculative_method": spec["method"], "num_speculative_tokens": spec["num_speculative_tokens"]}
        if spec["method"] == "ngram":
            settings.update(prompt_lookup_min=spec["prompt_lookup_min"], prompt_lookup_max=spec["prompt_lookup_max"])
        else:
            settings["draft_model"] = spec["model"]
    start = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype="float32",
        num_kv_blocks=4096,
        num_threads=2,
        enable_prefix_caching=False,
        **job["limits"],
        **settings,
    )
    load_s = time.perf_counter() - start
    greedy = SamplingParams(max_tokens=job["max_tokens"], temperature=0, ignore_eos=True)
    llm.generate(job["prompts"][:2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    result: dict = {"load_s": load_s, "runs": {}, "engine": "baton"}
    for concurrency in job["concurrencies"]:
        before = _counters(llm)
        run = timed_decode(llm.core, job["prompts"], concurrency, list, greedy)
        if before is not None:
            after = _counters(llm)
            run["counters"] = {k: after[k] - before[k] for k in after}
        result["runs"][str(concurrency)] = run
    llm.shutdown()
    return result


def _counters(llm) -> dict[str, int] | None:
    if llm.core.speculator is None:
        return None
    stats = llm.core.speculator.stats
    return {
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
    }


# -- the harness -------------------------------------------------------------------------------


def others_cores(result: dict) -> float:
    return max(run["others_cores"] for run in result["runs"].values())


def run_one(engine: str, job: dict, tag: str, tries: int, max_wait_s: float) -> dict:
    """One fresh process of `engine`; repeated (up to `tries` in all) while the rest of the
    machine used QUIET_CORES or more during a timed part."""
    for attempt in range(tries):
        busy = wait_quiet(max_wait_s)
        print(f"  {tag}: {engine} (load {load1():.2f}, busy {busy:.2f} cores) ...", flush=True)
        result = run_engine(engine, job, tag)
        if "error" in result or others_cores(result) < QUIET_CORES or attempt == tries - 1:
            return result
        print(f"    noisy (others used {others_cores(result):.2f} cores): again", flush=True)
    raise AssertionError("unreachable")


def bench_workload(workload: Workload, k: int, runs: int, quick: bool) -> tuple[dict, list[str]]:
    """Every run of the workload's four processes; the report's data and any failures."""
    results: dict[str, dict[str, list[dict]]] = {e: {m: [] for m in MODES} for e in ("baton", "vllm")}
    refused: dict[str, str] = {}
    for i in range(runs):
        engines = ("baton", "vllm") if i % 2 == 0 else ("vllm", "baton")
        for mode in MODES:
            for engine in engines:
                if (engine, mode) in refused:
                    continue
                job = job_for(workload, k, mode == "spec")
                tag = f"spec-{workload.name}-{mode}-{i}"
                result = run_one(engine, job, tag, tries=1 if quick else 3, max_wait_s=10.0 if quick else 180.0)
                if "error" in result:
                    refused[engine, mode] = result["error"]
                    # An engine-core process's refusal reaches here as a summary; its log has the cause.
                    print(
                        f"    {engine} refused {mode}: {result['error']} (log {OUT}/logs/{tag}-{engine}.log)",
                        flush=True,
                    )
                    continue
                results[engine][mode].append(result)
    failures = report(workload, results, refused)
    data = {"results": results, "refused": {f"{e} {m}": msg for (e, m), msg in refused.items()}}
    return data, failures


def report(workload: Workload, results: dict, refused: dict) -> list[str]:
    failures = []
    method = vllm_config(workload, 0)["method"]
    print(
        f"\n{workload.name} ({method}, {len(workload.prompts)} requests x {workload.params.max_tokens} tokens, greedy)"
    )
    for (engine, mode), message in refused.items():
        print(f"  {engine} {mode}: refused: {message}")
    for concurrency in map(str, CONCURRENCIES):
        best: dict[str, dict[str, float]] = {}
        for engine, modes in results.items():
            if not modes["plain"] or not modes["spec"]:
                continue
            plain = min(r["runs"][concurrency]["tpot_s"] for r in modes["plain"])
            spec = min(r["runs"][concurrency]["tpot_s"] for r in modes["spec"])
            best[engine] = {"plain": plain, "spec": spec}
            counts = modes["spec"][0]["runs"][concurrency].get("counters")
            if counts and counts["num_draft_tokens"]:
                rate = counts["num_accepted_tokens"] / counts["num_draft_tokens"]
                length = 1 + counts["num_accepted_tokens"] / max(counts["num_drafts"], 1)
                accept = f"acceptance {rate:4.2f}, mean length {length:4.2f}, {counts['num_draft_tokens']} draft tokens"
            elif counts:
                accept = "no drafts"
            else:
                accept = "no counters"
            noisy = max(others_cores(r) for r in modes["plain"] + modes["spec"])
            tokens = modes["plain"][0]["runs"][concurrency]["token_ids"]
            same = all(r["runs"][concurrency]["token_ids"] == tokens for r in modes["plain"] + modes["spec"])
            if not same:
                failures.append(f"{workload.name} conc {concurrency}: {engine}'s speculative greedy output differs")
            print(
                f"  conc {concurrency} {engine:5}: TPOT plain {plain * 1e3:7.2f} ms, spec {spec * 1e3:7.2f} ms"
                f" -> spec/plain {spec / plain:5.2f}x; {accept}; greedy spec == plain: {same};"
                f" others' CPU up to {noisy:.2f} cores"
            )
        if len(best) == 2:
            b, v = best["baton"], best["vllm"]
            print(
                f"  conc {concurrency} Baton / vLLM TPOT: speculative {b['spec'] / v['spec']:5.2f}x,"
                f" plain {b['plain'] / v['plain']:5.2f}x"
            )
    if all(results[e]["plain"] for e in ("baton", "vllm")):
        runs = [results[e]["plain"][0]["runs"][str(CONCURRENCIES[0])]["token_ids"] for e in ("baton", "vllm")]
        equal, frac = agreement(*runs)
        print(
            f"  Baton vs vLLM greedy tokens: {equal}/{len(runs[0])} requests equal,"
            f" mean agreeing prefix {frac:.1%} of each output"
        )
    return failures


def run_speculative(args: argparse.Namespace) -> None:
    chosen = [w for w in workloads(args.quick) if w.name in NAMES]
    print(f"speculative: {', '.join(w.name for w in chosen)}; k 3; {args.runs} run(s) per engine and mode")
    data, failures = {}, []
    for workload in chosen:
        data[workload.name], failed = bench_workload(workload, 3, args.runs, args.quick)
        failures += failed
    print(f"wrote {save('speculative', data)}")
    if failures:
        sys.exit("; ".join(failures))
