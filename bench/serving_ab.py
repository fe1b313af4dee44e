"""One Baton server setting against another, served: `baton serve` started once per arm per
round, the order alternating, loaded with the vLLM comparison's loads.

    python bench/serving_ab.py core-process [--rounds 3] [--quick]
    python bench/serving_ab.py thread-pool [--rounds 3] [--quick]
    python bench/serving_ab.py local-sockets [--rounds 3] [--quick]

core-process  the engine core in a process of its own (`engine.runner.core_process: true`,
              the default for a one-rank replica) against the engine loop on a thread of the
              replica's process (`false`).
thread-pool   the CPU kernels on their own thread pool in the engine's process (the default
              there: kernels/csrc/thread_pool.h) against OpenMP (`BATON_CPU_THREAD_POOL=0`
              in the server's environment).
local-sockets output channels on a Unix socket between the gateway and the engine replica
              on its node (`gateway.local_output_sockets: true`, the default) against Ray
              streams (`false`).

The server is the vLLM comparison's (bench/peer_vllm_serving.py: one colocated replica on
both cores, 16,384 KV blocks, 2048-token steps), loaded with its warm-up and loads (the same
seeds for both arms in a round). Prints each round's numbers and the ratios of the first
arm to the second; results go to .baton/peer-vllm/<comparison>-TIME.json. Needs no vLLM.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from peer_vllm import OUT
from peer_vllm_serving import LOADS, METRICS, serve_and_load, value


@dataclass(frozen=True)
class Arm:
    sets: tuple[str, ...] = ()  # --set overrides of Baton's config
    env: tuple[tuple[str, str], ...] = ()  # the server's environment, added to ours


COMPARISONS = {
    "core-process": {
        "process": Arm(sets=("engine.runner.core_process=true",)),
        "thread": Arm(sets=("engine.runner.core_process=false",)),
    },
    "thread-pool": {
        "pool": Arm(),
        "openmp": Arm(env=(("BATON_CPU_THREAD_POOL", "0"),)),
    },
    "local-sockets": {
        "socket": Arm(sets=("gateway.local_output_sockets=true",)),
        "ray": Arm(sets=("gateway.local_output_sockets=false",)),
    },
}


def print_round(index: int, arms: list[str], results: dict) -> None:
    first, second = arms
    print(f"\nround {index + 1}: start-up " + ", ".join(f"{m} {r['ready_s']:.1f} s" for m, r in results.items()))
    print(f"{'load':38} {'arm':8}" + "".join(f"{label:>11}" for label, _, _ in METRICS) + "  cores: server client")
    for load in LOADS:
        for arm in arms:
            r = results[arm]["loads"][load.name]
            cells = "".join(f"{value(r, path) or 0:11.1f}" for _, path, _ in METRICS)
            cores = r["cores"]
            name = load.name if arm == first else ""
            print(f"{name:38} {arm:8}{cells}  {cores['server']:5.2f}  {cores['client']:5.2f}")
        a, b = results[first]["loads"][load.name], results[second]["loads"][load.name]
        print(
            f"{'':38} {'ratio':8}" + "".join(f"{ratio(value(a, path), value(b, path)):>11}" for _, path, _ in METRICS)
        )


def ratio(a: float | None, b: float | None) -> str:
    return "  n/a" if a is None or not b else f"{a / b:5.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("comparison", choices=sorted(COMPARISONS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the loads' small request counts")
    args = parser.parse_args()
    arms = COMPARISONS[args.comparison]
    names = list(arms)
    started = time.strftime("%Y%m%d-%H%M%S")
    rounds = []
    for i in range(args.rounds):
        order = names if i % 2 == 0 else list(reversed(names))
        seed = 31 + 10 * i
        print(f"round {i + 1}/{args.rounds}: {' then '.join(order)}, seeds {seed}-{seed + len(LOADS)}", flush=True)
        results = {}
        for name in order:
            run_dir = OUT / f"{args.comparison}-{started}" / f"round{i + 1}" / name
            arm = arms[name]
            results[name] = serve_and_load(
                "baton", run_dir, args.quick, seed, baton_sets=arm.sets, baton_env=dict(arm.env)
            )
        rounds.append({name: results[name] for name in names})
        print_round(i, names, rounds[-1])
    print(f"\n{names[0]} / {names[1]} per load, one number per round (out tok/s and goodput: higher is better)")
    for load in LOADS:
        cells = []
        for label, path, _ in METRICS:
            per_round = [
                ratio(value(r[names[0]]["loads"][load.name], path), value(r[names[1]]["loads"][load.name], path))
                for r in rounds
            ]
            cells.append(f"{label} " + "/".join(x.strip() for x in per_round))
        print(f"  {load.name:38} " + "  ".join(cells))
    out = OUT / f"{args.comparison}-{started}.json"
    out.write_text(json.dumps(rounds, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
