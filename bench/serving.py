"""Service-level benchmarks: a local Baton per configuration, loaded by `baton bench`, compared.

    python bench/serving.py ttft    [--model bench]
    python bench/serving.py disagg  [--model bench] [--rates 0.5,1,1.5,2] [--num-requests 40] [--out DIR]
    python bench/serving.py routing [--model bench] [--rates 1,2]   [--num-requests 240] [--out DIR]
    python bench/serving.py interference [--model bench] [--rates 1.25] [--num-requests 80] [--out DIR]

ttft     TTFT of 2048-token prompts, one at a time: colocated (1 replica) vs disaggregated
         (1 prefill + 1 decode); goal disaggregated <= 1.1x colocated.
disagg   colocated (2 colocated replicas) vs disaggregated (1 prefill + 1 decode replica):
         the same number of engine workers, each one CPU thread, on a mix of long prompts
         with short replies and short prompts with longer replies. Headline: TPOT p99 and
         goodput (TTFT and TPOT SLO).
interference
         a steady decode load (short prompts, 128-token replies) with long prompts (2k
         tokens) arriving among it, on 2 colocated replicas vs 1 prefill + 1 decode; each
         mode also runs "quiet" (the decode load alone, at the same rate of short
         requests). Headline: the short requests' TPOT p99; goal disaggregated <= 1.25x its
         quiet TPOT p99 while colocated degrades.
routing  prefix-aware placement vs round robin (prefix-blind)
         with 2 prefill replicas and 1 decode replica, on shared-prefix prompts whose
         prefixes together overflow one replica's KV cache. Headline: TTFT p90 and cached-
         token ratio; goal TTFT p90 <= 0.33x the prefix-blind one.

Each configuration ("arm") runs in its own process (`--only-arm`): Ray, Redis and the app
start, the sweep runs with the same seed (so the same prompts and arrival times), and
everything stops. Results go to OUT/SCENARIO/ARM/ (result.json and plots); the comparison
table and plot to OUT/SCENARIO/. `--set ARM:dotted.key=value` changes one config field of
one arm, e.g. `--set round-robin:router.placement=power_of_two` (Serve's default router).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from baton.services.loadtest.lengths import LengthDistribution as L
from baton.services.loadtest.workloads.random import RandomWorkload, RequestClass
from baton.services.loadtest.workloads.shared_prefix import SharedPrefixWorkload
from common import bench_model

ONE_THREAD = {"runner": {"num_threads": 1}}


@dataclass(frozen=True)
class Scenario:
    arms: dict[str, dict[str, Any]]  # arm -> config overrides (merged over configs/local.yaml)
    rates: str  # default sweep
    num_requests: int  # per rate
    slo_ms: tuple[float, float]  # TTFT, TPOT
    headline: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    concurrency: int | None = None  # requests in flight at most (None: open loop)
    # arm -> (workload variant, rate factor); arms not named run the scenario's workload
    workloads: dict[str, tuple[str, float]] = field(default_factory=dict)


def _engine(num_kv_blocks: int = 1024, max_model_len: int = 2048) -> dict[str, Any]:
    return {"model": {"max_model_len": max_model_len}, "cache": {"num_kv_blocks": num_kv_blocks}, **ONE_THREAD}


# the same number of engine workers, one CPU each
_COLOCATED_2 = {
    "mode": "colocated",
    "engine": _engine(),
    "colocated": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}},
}
_DISAGGREGATED_1_1 = {
    "mode": "disaggregated",
    "engine": _engine(),
    "prefill": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}},
    "decode": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}},
}

SCENARIOS: dict[str, Scenario] = {
    # TTFT of 2k-token prompts, one at a time: disaggregation must not delay the first token
    # (it is streamed from the prefill worker before the handover).
    "ttft": Scenario(
        arms={
            "colocated": {
                "mode": "colocated",
                "engine": _engine(max_model_len=4096),
                "colocated": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}},
            },
            "disaggregated": {
                "mode": "disaggregated",
                "engine": _engine(max_model_len=4096),
                "prefill": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}},
                "decode": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}},
            },
        },
        rates="inf",
        num_requests=12,
        slo_ms=(5000.0, 200.0),
        headline=[("TTFT p50 (ms)", ("ttft_ms", "p50")), ("TTFT p90 (ms)", ("ttft_ms", "p90"))],
        concurrency=1,
    ),
    "disagg": Scenario(
        arms={"colocated": _COLOCATED_2, "disaggregated": _DISAGGREGATED_1_1},
        rates="0.5,1,1.5,2",
        num_requests=40,
        slo_ms=(2000.0, 100.0),
        headline=[
            ("TPOT p99 (ms)", ("tpot_ms", "p99")),
            ("TTFT p90 (ms)", ("ttft_ms", "p90")),
            ("goodput (req/s)", ("goodput",)),
            ("SLO attainment", ("_attainment",)),
        ],
    ),
    "interference": Scenario(
        arms={
            "colocated": _COLOCATED_2,
            "colocated-quiet": _COLOCATED_2,
            "disaggregated": _DISAGGREGATED_1_1,
            "disaggregated-quiet": _DISAGGREGATED_1_1,
        },
        rates="1.25",
        num_requests=80,
        slo_ms=(5000.0, 100.0),
        headline=[
            ("short TPOT p99 (ms)", ("groups", "short-prompt", "tpot_ms", "p99")),
            ("short TPOT p50 (ms)", ("groups", "short-prompt", "tpot_ms", "p50")),
            ("long TTFT p90 (ms)", ("groups", "long-prompt", "ttft_ms", "p90")),
            ("goodput (req/s)", ("metrics", "goodput")),
        ],
        # the decode load alone: the short class at its rate in the mix (4 of every 5 requests)
        workloads={"colocated-quiet": ("quiet", 0.8), "disaggregated-quiet": ("quiet", 0.8)},
    ),
    "routing": Scenario(
        arms={
            "prefix-aware": {
                "mode": "disaggregated",
                "engine": _engine(),
                "prefill": {
                    "num_replicas": 2,
                    "ray_actor_options": {"num_cpus": 0.5},
                    "engine_overrides": {"cache": {"num_kv_blocks": 320}},  # 5120 tokens: 5 of the 8 prefixes
                },
                "decode": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}},
                "router": {"placement": "prefix_aware"},
            },
            "round-robin": {  # prefix-blind baseline
                "mode": "disaggregated",
                "engine": _engine(),
                "prefill": {
                    "num_replicas": 2,
                    "ray_actor_options": {"num_cpus": 0.5},
                    "engine_overrides": {"cache": {"num_kv_blocks": 320}},
                },
                "decode": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}},
                "router": {"placement": "round_robin"},
            },
        },
        rates="1,2",
        # The first request of each prefix misses whatever the policy (8 of the run); 240
        # requests let placement, not that cold start, decide the p90.
        num_requests=240,
        slo_ms=(1000.0, 150.0),
        headline=[
            ("TTFT p90 (ms)", ("ttft_ms", "p90")),
            ("TTFT p50 (ms)", ("ttft_ms", "p50")),
            ("cached-token ratio", ("cached_token_ratio",)),
            ("goodput (req/s)", ("goodput",)),
        ],
    ),
}


def workload_for(scenario: str, variant: str = "main"):
    if scenario == "interference":
        short = RequestClass("short-prompt", 4, L.parse("uniform:32:128"), L.parse("128"))
        long = RequestClass("long-prompt", 1, L.parse("uniform:1536:2040"), L.parse("8"))
        return RandomWorkload([short] if variant == "quiet" else [short, long])
    if scenario == "ttft":
        return RandomWorkload([RequestClass("2k-prompt", 1, L.parse("2048"), L.parse("8"))])
    if scenario == "disagg":
        return RandomWorkload(
            [
                RequestClass("long-prompt", 1, L.parse("uniform:768:1024"), L.parse("16")),
                RequestClass("short-prompt", 1, L.parse("uniform:32:128"), L.parse("64")),
            ]
        )
    # 8 equally popular system prompts of 1024 tokens: 8192 tokens in all, a prefill replica
    # caches 5120 (5 of them), the two together all 8. Round robin sends every prefix to both
    # replicas, so each thrashes; prefix-aware placement can split the prefixes between them.
    return SharedPrefixWorkload(8, L.parse("1024"), L.parse("uniform:16:48"), L.parse("16"), "uniform")


def arm_overrides(scenario: str, arm: str, settings: list[str]) -> dict[str, Any]:
    overrides = yaml.safe_load(yaml.safe_dump(SCENARIOS[scenario].arms[arm]))  # a deep copy
    overrides["server"] = {"http_port": 0, "grpc_port": 0}
    for setting in settings:
        target, _, assignment = setting.partition(":")
        if target != arm:
            continue
        key, _, value = assignment.partition("=")
        node = overrides
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    return overrides


def model_path(name: str) -> str | None:
    if name == "tiny":
        return None  # the embedded default, built once
    if name == "bench":
        return str(bench_model())
    return name


def run_arm(args: argparse.Namespace, arm: str, out_dir: Path) -> None:
    """One configuration: start it, run the sweep, write the result, stop it (this process only)."""
    from baton.services.launcher.launcher import LocalDeployment, resolve_config
    from baton.services.loadtest.benchmark import BenchmarkSpec, run_benchmark_sync
    from baton.services.loadtest.metrics import Slo
    from baton.services.loadtest.plots import write_run_plots
    from baton.services.loadtest.report import format_summary, write_result
    from baton.services.loadtest.runner import Bounds, LoadSpec

    scenario = SCENARIOS[args.scenario]
    overrides = arm_overrides(args.scenario, arm, args.set)
    model = model_path(args.model)
    overrides["engine"]["model"]["served_model_name"] = f"baton-{Path(model).name if model else 'tiny'}"
    config = resolve_config(None, model, overrides)
    variant, rate_factor = scenario.workloads.get(arm, ("main", 1.0))
    rates = [float(r) * rate_factor for r in (args.rates or scenario.rates).split(",")]
    ttft_ms, tpot_ms = scenario.slo_ms
    print(f"[{arm}] starting Baton ({config.mode}) ...", flush=True)
    run_dir = Path(tempfile.mkdtemp(prefix="baton-bench-", dir="/tmp"))
    with LocalDeployment(config, run_dir, num_cpus=args.num_cpus) as deployment:
        # after Ray's own handlers: a TERM from the parent stops Ray and Redis on the way out
        signal.signal(signal.SIGTERM, _raise_interrupt)
        spec = BenchmarkSpec(
            workload=workload_for(args.scenario, variant),
            loads=[LoadSpec(rate=r, max_concurrency=scenario.concurrency) for r in rates],
            bounds=Bounds(args.num_requests or scenario.num_requests, args.duration),
            address=deployment.grpc_address,
            slo=Slo(ttft_ms / 1000, tpot_ms / 1000),
            seed=args.seed,
            warmup=args.warmup,
            label=arm,
            progress=True,
        )
        result = run_benchmark_sync(spec)
    result["config"]["deployment"] = overrides
    write_result(result, out_dir / "result.json")
    write_run_plots(result, out_dir)
    print(format_summary(result), flush=True)


def headline(scenario: Scenario, results: dict[str, dict[str, Any]]) -> str:
    lines = []
    for arm, result in results.items():
        for run in result["runs"]:
            m = run["metrics"]
            cells = []
            for name, path in scenario.headline:
                if path == ("_attainment",):
                    value = m["num_good"] / m["num_requests"] if m["num_requests"] else None
                    cells.append(f"{name} {value:.0%}" if value is not None else f"{name} -")
                    continue
                value = run if path[0] in ("metrics", "groups") else m  # the run's fields, or its metrics'
                for key in path:
                    value = value.get(key) if isinstance(value, dict) else None
                text = "-" if value is None else (f"{value:.1%}" if "ratio" in name else f"{value:.2f}")
                cells.append(f"{name} {text}")
            lines.append(f"{arm:<20} {run['load']['label']:<10} " + "  ".join(cells))
    return "\n".join(lines)


def _raise_interrupt(*_) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--model", default="bench", help="tiny, bench (the ~30M-parameter random Llama), or a folder")
    parser.add_argument("--rates", default=None, help="comma-separated request rates (default: the scenario's)")
    parser.add_argument("--num-requests", type=int, default=None, help="requests per rate (default: the scenario's)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per rate after which no request starts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=8, help="warm-up requests per arm (shaped like the workload)")
    parser.add_argument("--num-cpus", type=int, default=4, help="logical CPUs Ray may hand out")
    parser.add_argument("--set", action="append", default=[], metavar="ARM:KEY=VALUE", help="override a config field")
    parser.add_argument("--arms", default=None, help="comma-separated arms to run (default: all)")
    parser.add_argument("--out", default=".baton/bench-results/serving", help="results folder")
    parser.add_argument("--only-arm", default=None, help=argparse.SUPPRESS)  # the per-arm child process
    args = parser.parse_args()

    scenario = SCENARIOS[args.scenario]
    root = Path(args.out) / args.scenario
    if args.only_arm:
        run_arm(args, args.only_arm, root / args.only_arm)
        return 0

    arms = args.arms.split(",") if args.arms else list(scenario.arms)
    unknown = set(arms) - set(scenario.arms)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; {args.scenario} has {sorted(scenario.arms)}")
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _raise_interrupt)
    for arm in arms:  # one process per arm: a fresh Ray, Redis and app each time
        child = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--only-arm", arm])
        try:
            code = child.wait()
        except KeyboardInterrupt:
            child.terminate()  # the child stops its deployment
            child.wait()
            print(f"interrupted during arm {arm}", file=sys.stderr)
            return 130
        if code != 0:
            print(f"arm {arm} failed", file=sys.stderr)
            return 1

    from baton.services.loadtest.compare import compare_files
    from baton.services.loadtest.report import load_result

    paths = [root / arm / "result.json" for arm in scenario.arms if (root / arm / "result.json").exists()]
    results = {p.parent.name: load_result(p) for p in paths}
    text = headline(scenario, results)
    if len(paths) >= 2:
        table, plot = compare_files(paths, root, labels=list(results))
        text = f"{table}\n\n{text}"
        print(f"wrote {plot}")
    (root / "summary.txt").write_text(text + "\n")
    print(text)
    print(f"\n{args.scenario}: {time.monotonic() - started:.0f} s; results under {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
