"""`python bench/autoscaling.py`: a step load (quiet, 3x, quiet) on three ways of sizing
prefill and decode, on the same local Ray cluster budget of CPUs.

    fixed    1 prefill + 1 decode replica
    serve    Serve's request-count autoscaling (target_ongoing_requests), 1..2 per role
    baton    Baton's signal policies (services/autoscaling/policy.py), 1..2 per role

Every replica gets the same fraction of a CPU and one torch thread; Ray hands out at most
`--num-cpus` logical CPUs, enough for 2 + 2 replicas and the gateway, so the autoscaled
arms may use up to twice the fixed arm's replicas and the question is what they buy with
them. The load is open loop (Poisson arrivals, seeded: the same prompts at the same times
in every arm): `--quiet-s` at the base rate, `--peak-s` at 3x, `--quiet-s` at the base rate
again. The base rate is `--quiet-load` x the fixed arm's closed-loop capacity (measured
first in that arm) unless `--rate` gives it.

Per arm: goodput (requests meeting TTFT <= --slo-ttft-s and TPOT <= --slo-tpot-s, per
second of the load), TTFT/TPOT percentiles, and replica-seconds per role (RUNNING replicas
in Serve's status, sampled every 0.5 s, integrated from the first send to the last answer).
Then the ratios baton/fixed and baton/serve. Written to OUT: ARM.json (every request and the
replica samples), ARM-timeline.csv (per second: replicas per role beside the TTFT and TPOT
of the requests sent in it), summary.json and autoscaling.png.

Each arm runs in a process of its own (a fresh Ray, Redis and app).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from baton.services.loadtest.metrics import Slo, meets_slo, percentile, request_metrics
from baton.services.loadtest.records import RequestRecord
from common import bench_model

ARMS = ("fixed", "serve", "baton")
REPLICA_CPUS = 0.5
SAMPLE_S = 0.5


def autoscaling(arm: str, args: argparse.Namespace, role: str) -> dict[str, Any] | None:
    if arm == "fixed":
        return None
    section: dict[str, Any] = {
        "min_replicas": 1,
        "max_replicas": 2,
        "upscale_delay_s": args.upscale_delay_s,
        "downscale_delay_s": args.downscale_delay_s,
        "metrics_interval_s": 0.5,
        "look_back_period_s": 3.0,
    }
    if arm == "serve":
        section["target_ongoing_requests"] = args.target_ongoing_requests
    else:  # aim inside the SLO, so a replica is added before it is missed
        knobs = (
            {"ttft_target_s": args.slo_ttft_s / 2} if role == "prefill" else {"tpot_target_s": args.slo_tpot_s * 0.75}
        )
        section["policy"] = {"policy_kwargs": knobs}
    return section


def overrides(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {
        "mode": "disaggregated",
        "server": {"http_port": 0, "grpc_port": 0},
        "engine": {
            "model": {"max_model_len": 1024},
            "cache": {"num_kv_blocks": 512},
            "scheduler": {"max_num_seqs": 16},
            "runner": {"num_threads": 1},
        },
    }
    for role in ("prefill", "decode"):
        section: dict[str, Any] = {"ray_actor_options": {"num_cpus": REPLICA_CPUS}}
        scaling = autoscaling(arm, args, role)
        if scaling is None:
            section["num_replicas"] = 1
        else:
            section["autoscaling"] = scaling
        config[role] = section
    return config


def workload(args: argparse.Namespace, rate: float, vocab_size: int) -> list[tuple[float, str, list[int], int]]:
    """(arrival s, phase, prompt token ids, max tokens): Poisson arrivals, 3x in the peak."""
    rng = random.Random(args.seed)
    phases = [("quiet", args.quiet_s, rate), ("peak", args.peak_s, 3 * rate), ("after", args.quiet_s, rate)]
    requests, start = [], 0.0
    for name, length, phase_rate in phases:
        t = start
        while (t := t + rng.expovariate(phase_rate)) < start + length:
            prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(*args.prompt_len))]
            requests.append((t, name, prompt, rng.randint(*args.output_len)))
        start += length
    return requests


class ReplicaSampler:
    """RUNNING (and STARTING) replicas per role from Serve's status, every SAMPLE_S."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from ray import serve

        while not self._stop.wait(SAMPLE_S):
            deployments = serve.status().applications["baton"].deployments
            sample = {"t_s": time.perf_counter() - self.t0}
            for role in ("prefill", "decode"):
                states = deployments[role].replica_states
                sample[role] = states.get("RUNNING", 0)
                sample[f"{role}_starting"] = states.get("STARTING", 0)
            self.samples.append(sample)

    def stop(self) -> list[dict[str, float]]:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.samples


def replica_seconds(samples: list[dict[str, float]], role: str, end_s: float) -> float:
    """The RUNNING count as a step function over [0, end_s]."""
    inside = [s for s in samples if s["t_s"] <= end_s]
    total = 0.0
    for here, after in zip(inside, [*inside[1:], {"t_s": end_s}]):
        total += here[role] * (after["t_s"] - max(here["t_s"], 0.0))
    return total


async def drive(address: str, requests, t0: float) -> list[RequestRecord]:
    from baton.services.loadtest.backends.base import BenchRequest
    from baton.services.loadtest.backends.grpc import GrpcBackend

    backend = GrpcBackend(address, timeout_s=300.0)
    records: list[RequestRecord] = []

    async def one(index: int, arrival: float, phase: str, prompt: list[int], max_tokens: int) -> None:
        response = await backend.send(BenchRequest(max_tokens, prompt_token_ids=prompt))
        start = response.sent_at - t0
        records.append(RequestRecord(index, index, 0, phase, arrival, start, len(prompt), max_tokens, response))

    tasks = []
    for index, (arrival, phase, prompt, max_tokens) in enumerate(requests):
        if (delay := t0 + arrival - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(index, arrival, phase, prompt, max_tokens)))
    await asyncio.gather(*tasks)
    await backend.close()
    return sorted(records, key=lambda r: r.index)


async def capacity(address: str, args: argparse.Namespace, vocab_size: int) -> float:
    """Completed requests/s of the fixed arm at 8 requests in flight, for the workload's shapes."""
    rng = random.Random(args.seed + 1)
    shapes = [
        ([rng.randrange(3, vocab_size) for _ in range(rng.randint(*args.prompt_len))], rng.randint(*args.output_len))
        for _ in range(24)
    ]
    from baton.services.loadtest.backends.base import BenchRequest
    from baton.services.loadtest.backends.grpc import GrpcBackend

    backend = GrpcBackend(address, timeout_s=300.0)
    queue = list(shapes)
    start = time.perf_counter()

    async def worker() -> None:
        while queue:
            prompt, max_tokens = queue.pop()
            response = await backend.send(BenchRequest(max_tokens, prompt_token_ids=prompt))
            assert response.error is None, response.error

    await asyncio.gather(*(worker() for _ in range(8)))
    await backend.close()
    return len(shapes) / (time.perf_counter() - start)


def run_arm(arm: str, args: argparse.Namespace, out: Path) -> None:
    from baton.services.launcher.launcher import LocalDeployment, resolve_config

    model = None if args.model == "tiny" else str(bench_model()) if args.model == "bench" else args.model
    config = resolve_config(None, model, overrides(arm, args))
    run_dir = Path(tempfile.mkdtemp(prefix="baton-autoscaling-", dir="/tmp"))
    print(f"[{arm}] starting (num_cpus {args.num_cpus}) ...", flush=True)
    with LocalDeployment(config, run_dir, num_cpus=args.num_cpus, grace_period_s=5.0) as deployment:
        vocab_size = _vocab_size(config)
        warm = workload(argparse.Namespace(**{**vars(args), "seed": args.seed + 2}), 4.0, vocab_size)[:8]
        asyncio.run(drive(deployment.grpc_address, warm, time.perf_counter()))
        measured = None
        rate = args.rate
        if rate is None:
            measured = asyncio.run(capacity(deployment.grpc_address, args, vocab_size))
            rate = args.quiet_load * measured
            print(f"[{arm}] capacity {measured:.2f} req/s at 8 in flight -> base rate {rate:.2f} req/s", flush=True)
        requests = workload(args, rate, vocab_size)
        print(f"[{arm}] {len(requests)} requests over {2 * args.quiet_s + args.peak_s:.0f} s", flush=True)
        t0 = time.perf_counter()
        sampler = ReplicaSampler(t0)
        records = asyncio.run(drive(deployment.grpc_address, requests, t0))
        samples = sampler.stop()
    result = summarize(arm, records, samples, args, rate)
    result["capacity_req_s"] = measured
    result["samples"] = samples
    result["requests"] = [_request_row(r) for r in records]
    (out / f"{arm}.json").write_text(json.dumps(result, indent=1))
    write_timeline(out / f"{arm}-timeline.csv", result)
    print(f"[{arm}] {_line(result)}", flush=True)


def _vocab_size(config) -> int:
    model_dir = Path(config.engine.model.model)
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def _request_row(record: RequestRecord) -> dict[str, Any]:
    m = request_metrics(record)
    return {
        "arrival_s": record.scheduled_s,
        "phase": record.group,
        "ok": m.ok,
        "ttft_s": m.ttft_s,
        "tpot_s": m.tpot_s,
        "error": record.response.error,
    }


def summarize(arm: str, records, samples, args: argparse.Namespace, rate: float) -> dict[str, Any]:
    slo = Slo(args.slo_ttft_s, args.slo_tpot_s)
    metrics = [request_metrics(r) for r in records]
    done = [m for m in metrics if m.ok]
    end_s = max((r.start_s + r.response.end_s for r in records), default=0.0)
    good = sum(meets_slo(m, slo) for m in done)
    seconds = {role: replica_seconds(samples, role, end_s) for role in ("prefill", "decode")}
    return {
        "arm": arm,
        "base_rate_req_s": rate,
        "slo": {"ttft_s": args.slo_ttft_s, "tpot_s": args.slo_tpot_s},
        "duration_s": end_s,
        "num_sent": len(records),
        "num_completed": len(done),
        "num_good": good,
        "goodput_req_s": good / end_s if end_s else 0.0,
        "ttft_s": {f"p{q}": percentile([m.ttft_s for m in done], q) for q in (50, 90, 99)},
        "tpot_s": {f"p{q}": percentile([m.tpot_s for m in done if m.tpot_s is not None], q) for q in (50, 90, 99)},
        "replica_seconds": {**seconds, "total": sum(seconds.values())},
        "max_replicas": {role: max((s[role] for s in samples), default=0) for role in ("prefill", "decode")},
        "errors": sorted({r.response.error for r in records if r.response.error}),
    }


def write_timeline(path: Path, result: dict[str, Any]) -> None:
    """Per second of the load: the replicas RUNNING at its start, the mean TTFT and TPOT of the
    requests sent in it."""
    end = int(result["duration_s"]) + 1
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["t_s", "prefill_replicas", "decode_replicas", "num_sent", "ttft_mean_s", "tpot_mean_s"])
        for second in range(end):
            sample = next((s for s in reversed(result["samples"]) if s["t_s"] <= second), None)
            sent = [r for r in result["requests"] if second <= r["arrival_s"] < second + 1]
            ttft = [r["ttft_s"] for r in sent if r["ttft_s"] is not None]
            tpot = [r["tpot_s"] for r in sent if r["tpot_s"] is not None]
            writer.writerow(
                [
                    second,
                    sample["prefill"] if sample else 1,
                    sample["decode"] if sample else 1,
                    len(sent),
                    f"{sum(ttft) / len(ttft):.4f}" if ttft else "",
                    f"{sum(tpot) / len(tpot):.4f}" if tpot else "",
                ]
            )


def _line(r: dict[str, Any]) -> str:
    seconds = r["replica_seconds"]
    return (
        f"sent {r['num_sent']} done {r['num_completed']} good {r['num_good']} goodput {r['goodput_req_s']:.2f} req/s  "
        f"TTFT p50/p90 {r['ttft_s']['p50']:.2f}/{r['ttft_s']['p90']:.2f} s  "
        f"TPOT p50/p90 {1000 * r['tpot_s']['p50']:.0f}/{1000 * r['tpot_s']['p90']:.0f} ms  "
        f"replica-s prefill {seconds['prefill']:.0f} decode {seconds['decode']:.0f}  "
        f"max replicas {r['max_replicas']['prefill']}+{r['max_replicas']['decode']}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny (the embedded default), bench, or a folder")
    parser.add_argument("--quiet-s", type=float, default=40.0, help="seconds at the base rate, before and after")
    parser.add_argument("--peak-s", type=float, default=60.0, help="seconds at 3x the base rate")
    parser.add_argument("--rate", type=float, default=None, help="base rate, req/s (default: measured)")
    parser.add_argument("--quiet-load", type=float, default=0.4, help="base rate as a fraction of fixed capacity")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(192, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 48), metavar=("MIN", "MAX"))
    parser.add_argument("--slo-ttft-s", type=float, default=1.0)
    parser.add_argument("--slo-tpot-s", type=float, default=0.1)
    parser.add_argument("--target-ongoing-requests", type=float, default=2.0, help="the serve arm (Serve's default)")
    parser.add_argument("--upscale-delay-s", type=float, default=2.0)
    parser.add_argument("--downscale-delay-s", type=float, default=15.0)
    parser.add_argument("--num-cpus", type=int, default=3, help="logical CPUs Ray may hand out (every arm)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out", default=".baton/bench-results/autoscaling")
    parser.add_argument("--only-arm", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.only_arm:
        run_arm(args.only_arm, args, out)
        return 0

    started = time.monotonic()
    argv = [a for a in sys.argv[1:]]
    arms = args.arms.split(",")
    for arm in arms:  # the first arm measures the base rate (unless --rate), the others reuse it
        code = subprocess.call([sys.executable, __file__, *argv, "--only-arm", arm])
        if code != 0:
            print(f"arm {arm} failed", file=sys.stderr)
            return 1
        if args.rate is None:
            args.rate = json.loads((out / f"{arm}.json").read_text())["base_rate_req_s"]
            argv += ["--rate", f"{args.rate:.4f}"]
    results = {arm: json.loads((out / f"{arm}.json").read_text()) for arm in arms}
    print(
        f"\nSLO: TTFT <= {args.slo_ttft_s} s and TPOT <= {1000 * args.slo_tpot_s:.0f} ms; base rate {args.rate:.2f} "
        f"req/s, 3x for {args.peak_s:.0f} s between {args.quiet_s:.0f} s quiet phases"
    )
    for arm, r in results.items():
        print(f"{arm:<6} {_line(r)}")
    summary: dict[str, Any] = {
        "arms": {a: {k: v for k, v in r.items() if k not in ("samples", "requests")} for a, r in results.items()}
    }
    for other in ("fixed", "serve"):
        if "baton" in results and other in results:
            b, o = results["baton"], results[other]
            ratios = {
                "goodput": b["goodput_req_s"] / max(o["goodput_req_s"], 1e-9),
                "replica_seconds": b["replica_seconds"]["total"] / max(o["replica_seconds"]["total"], 1e-9),
                "prefill_replica_seconds": b["replica_seconds"]["prefill"] / max(o["replica_seconds"]["prefill"], 1e-9),
                "decode_replica_seconds": b["replica_seconds"]["decode"] / max(o["replica_seconds"]["decode"], 1e-9),
            }
            summary[f"baton/{other}"] = ratios
            print(
                f"baton/{other}: goodput {ratios['goodput']:.2f}x, replica-seconds {ratios['replica_seconds']:.2f}x "
                f"(prefill {ratios['prefill_replica_seconds']:.2f}x, decode {ratios['decode_replica_seconds']:.2f}x)"
            )
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    from autoscaling_plot import plot  # matplotlib only here

    plot(results, out / "autoscaling.png", args.quiet_s, args.peak_s, (args.slo_ttft_s, args.slo_tpot_s))
    print(f"wrote {out / 'autoscaling.png'}; {time.monotonic() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
