"""`baton serve` with the engine core in a process of its own against on the replica's thread.

    python bench/core_process.py [--rounds 2] [--quick]

The same server as the vLLM comparison's (bench/peer_vllm_serving.py: one colocated replica
on both cores, 16,384 KV blocks, 2048-token steps) is started twice per round, once with
`engine.runner.core_process: true` (the default for a one-rank replica) and once with
`false` (the engine loop on a thread of the replica's process), the order alternating per
round, and loaded with the comparison's warm-up and loads (the same seeds for both in a
round). Prints each round's numbers and the process / thread ratios; results go to
.baton/peer-vllm/core-process-TIME.json. Needs no vLLM.
"""

from __future__ import annotations

import argparse
import json
import time

from peer_vllm import OUT
from peer_vllm_serving import LOADS, METRICS, serve_and_load, value

MODES = {"process": ("engine.runner.core_process=true",), "thread": ("engine.runner.core_process=false",)}


def print_round(index: int, results: dict) -> None:
    print(f"\nround {index + 1}: start-up " + ", ".join(f"{m} {r['ready_s']:.1f} s" for m, r in results.items()))
    print(f"{'load':38} {'mode':8}" + "".join(f"{label:>11}" for label, _, _ in METRICS) + "  cores: server client")
    for load in LOADS:
        for mode in MODES:
            r = results[mode]["loads"][load.name]
            cells = "".join(f"{value(r, path) or 0:11.1f}" for _, path, _ in METRICS)
            cores = r["cores"]
            print(
                f"{load.name if mode == 'process' else '':38} {mode:8}{cells}  {cores['server']:5.2f}  {cores['client']:5.2f}"
            )
        p, t = results["process"]["loads"][load.name], results["thread"]["loads"][load.name]
        print(f"{'':38} {'p/t':8}" + "".join(f"{ratio(value(p, path), value(t, path)):>11}" for _, path, _ in METRICS))


def ratio(a: float | None, b: float | None) -> str:
    return "  n/a" if a is None or not b else f"{a / b:5.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the loads' small request counts")
    args = parser.parse_args()
    started = time.strftime("%Y%m%d-%H%M%S")
    rounds = []
    for i in range(args.rounds):
        order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
        seed = 31 + 10 * i
        print(f"round {i + 1}/{args.rounds}: {' then '.join(order)}, seeds {seed}-{seed + len(LOADS)}", flush=True)
        results = {}
        for mode in order:
            run_dir = OUT / f"core-process-{started}" / f"round{i + 1}" / mode
            results[mode] = serve_and_load("baton", run_dir, args.quick, seed, baton_sets=MODES[mode])
        rounds.append({mode: results[mode] for mode in MODES})
        print_round(i, rounds[-1])
    print("\nprocess / thread per load, one number per round (out tok/s and goodput: higher is better)")
    for load in LOADS:
        cells = []
        for label, path, _ in METRICS:
            per_round = [
                ratio(value(r["process"]["loads"][load.name], path), value(r["thread"]["loads"][load.name], path))
                for r in rounds
            ]
            cells.append(f"{label} " + "/".join(x.strip() for x in per_round))
        print(f"  {load.name:38} " + "  ".join(cells))
    out = OUT / f"core-process-{started}.json"
    out.write_text(json.dumps(rounds, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
