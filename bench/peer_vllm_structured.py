"""Constrained decoding, Baton vs vLLM's CPU build (issue 19's peer comparison).

The same bench model, prompts and JSON schema (bench/structured_output.py's array of
records, compact JSON on both: vLLM's disable_any_whitespace), temperature 1, each engine
in a fresh process, alternating; TPOT measured the same way in both
(bench/peer_vllm_structured_worker.py). Prints TPOT per engine, each engine's own
constrained/free overhead, and Baton/vLLM ratios. vLLM runs with its documented CPU
settings (bench/peer_vllm.py's vllm_env); `python bench/peer_vllm.py setup` makes its venv.

  python bench/peer_vllm_structured.py [--rounds 2] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

from common import bench_model
from peer_vllm import ENGINE_LIMITS, OUT, VPY, load1, vllm_env
from structured_output import RECORDS

HERE = Path(__file__).resolve().parent
WORKER = HERE / "peer_vllm_structured_worker.py"
BATCHES = (1, 32)


def run(engine: str, job: dict, tag: str) -> dict:
    work = OUT / "jobs"
    work.mkdir(parents=True, exist_ok=True)
    path_in, path_out = work / f"{tag}.in.json", work / f"{tag}.out.json"
    path_in.write_text(json.dumps(job))
    python, env = (str(VPY), vllm_env()) if engine == "vllm" else (sys.executable, None)
    log = OUT / "logs" / f"{tag}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        subprocess.run(
            [python, str(WORKER), engine, str(path_in), str(path_out)], stdout=out, stderr=out, env=env, check=True
        )
    return json.loads(path_out.read_text())["tpot_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    job = {
        "model": str(bench_model()),
        "schema": RECORDS,
        "prompts": [[rng.randrange(100, 8000) for _ in range(64)] for _ in range(max(BATCHES))],
        "max_tokens": args.max_tokens,
        "batches": BATCHES,
        "repeats": args.repeats,
        "limits": ENGINE_LIMITS,
    }
    results: dict[str, list[dict]] = {"baton": [], "vllm": []}
    for i in range(args.rounds):
        for engine in ("baton", "vllm") if i % 2 == 0 else ("vllm", "baton"):
            print(f"round {i + 1}: {engine} (load {load1():.2f}) ...", flush=True)
            results[engine].append(run(engine, job, f"structured-{engine}-{i}"))
    best = {e: {k: min(r[k] for r in runs) for k in runs[0]} for e, runs in results.items()}
    print(
        f"\nTPOT (ms, best of {args.rounds} rounds x {args.repeats} repeats), {args.max_tokens} tokens, temperature 1"
    )
    print(f"{'':<8} {'baton free':>11} {'baton schema':>13} {'vllm free':>10} {'vllm schema':>12} {'schema ratio':>13}")
    for batch in BATCHES:
        b_free, b_schema = best["baton"][f"batch{batch}-free"], best["baton"][f"batch{batch}-schema"]
        v_free, v_schema = best["vllm"][f"batch{batch}-free"], best["vllm"][f"batch{batch}-schema"]
        print(
            f"batch {batch:<2} {b_free * 1e3:>11.2f} {b_schema * 1e3:>13.2f} {v_free * 1e3:>10.2f} "
            f"{v_schema * 1e3:>12.2f} {b_schema / v_schema:>12.2f}x"
        )
        print(f"         overhead: baton {b_schema / b_free - 1:+.1%}, vllm {v_schema / v_free - 1:+.1%}")
    (OUT / "structured.json").write_text(json.dumps({"runs": results, "best": best}, indent=1))


if __name__ == "__main__":
    main()
