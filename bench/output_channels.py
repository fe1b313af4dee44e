"""Output channels on and off (`gateway.multiplex_outputs`), the same `baton serve` otherwise.

    python bench/output_channels.py [--rounds 3] [--num-requests 48] [--quick]

The Baton server of the vLLM comparison (bench/peer_vllm_serving.py: one colocated replica,
2 engine threads, the bench model), loaded at concurrency 16 (128 -> 256 tokens, greedy, one
token per streamed chunk) by the same `baton bench run --backend openai` command; the two
settings alternate, each run a fresh server, `--rounds` times. Prints output tok/s, TPOT,
TTFT and the server's cores per run, and the ratios on / off of each setting's best run
(other work on a shared machine only ever slows a run down) beside the median of the paired
ratios.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from statistics import median

import peer_vllm_serving as serving
import yaml
from peer_vllm_serving import WARMUP, Load, Server, bench_run

LOAD = Load(
    "c16", "concurrency 16, 128->256", ("--input-len", "128", "--output-len", "256", "--concurrency", "16"), 48, 16
)


def one_run(multiplex: bool, n: int, seed: int, out: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="baton-channels-", dir="/tmp"))
    write_config = serving.baton_config

    def with_setting(path: Path, http_port: int, stream_interval: int = 1) -> Path:
        write_config(path, http_port, stream_interval)
        config = yaml.safe_load(path.read_text())
        config.setdefault("gateway", {})["multiplex_outputs"] = multiplex
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    serving.baton_config = with_setting  # server_command writes the config through it
    try:
        server = Server("baton", run_dir)
    finally:
        serving.baton_config = write_config
    try:
        server.wait_ready()
        bench_run(server, WARMUP, WARMUP.quick_requests, seed + 100, out / f"warmup-{seed}-{multiplex}")
        return bench_run(server, LOAD, n, seed, out / f"{'on' if multiplex else 'off'}-{seed}")
    finally:
        server.stop()


def metrics(result: dict) -> dict[str, float]:
    m = result["metrics"]
    return {
        "tok_s": m["output_token_throughput"],
        "tpot_p50": m["tpot_ms"]["p50"],
        "tpot_p90": m["tpot_ms"]["p90"],
        "ttft_p90": m["ttft_ms"]["p90"],
        "server_cores": result["cores"]["server"],
        "others": result["cores"]["others"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=LOAD.num_requests)
    parser.add_argument("--quick", action="store_true", help="one round of 16 requests")
    args = parser.parse_args()
    rounds, n = (1, LOAD.quick_requests) if args.quick else (args.rounds, args.num_requests)
    out = Path(tempfile.mkdtemp(prefix="bench-channels-", dir="/tmp"))
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for r in range(rounds):
        for multiplex in (True, False) if r % 2 == 0 else (False, True):
            m = metrics(one_run(multiplex, n, 31 + r, out))
            runs[multiplex].append(m)
            print(
                f"round {r + 1}, channels {'on ' if multiplex else 'off'}: {m['tok_s']:.1f} tok/s, TPOT p50 "
                f"{m['tpot_p50']:.1f} ms, p90 {m['tpot_p90']:.1f} ms, TTFT p90 {m['ttft_p90']:.1f} ms, server "
                f"{m['server_cores']:.2f} cores (others {m['others']:.2f})",
                flush=True,
            )
    best_on = max(runs[True], key=lambda m: m["tok_s"])
    best_off = max(runs[False], key=lambda m: m["tok_s"])
    paired = median(on["tok_s"] / off["tok_s"] for on, off in zip(runs[True], runs[False], strict=True))
    print(
        f"on / off, best runs: output tok/s {best_on['tok_s']:.1f} / {best_off['tok_s']:.1f} = "
        f"{best_on['tok_s'] / best_off['tok_s']:.2f}x (median paired {paired:.2f}x); TPOT p50 "
        f"{best_on['tpot_p50']:.1f} / {best_off['tpot_p50']:.1f} ms = {best_on['tpot_p50'] / best_off['tpot_p50']:.2f}x"
    )
    print(f"logs: {out}")


if __name__ == "__main__":
    main()
