"""`python bench/overload.py`: 3x overload with admission control on and off.

For each arm, a fresh `baton serve` (configs/local-colocated.yaml, max_num_seqs 16, the
bench model), in a session of its own:
  1. capacity: `baton bench run --concurrency 16` (closed loop), its request throughput;
  2. overload: `baton bench run --rate 3 x capacity` (Poisson, open loop) for about 20 s.
Arms: "admission" (colocated.max_queue_delay_s 1.0) and "unbounded" (max_queue_delay_s null:
only the 512-request waiting bound). Prints, per arm, what was sent, completed and shed, the
completed requests' TTFT percentiles, and goodput (TTFT <= 2 s, TPOT <= 200 ms), then the
ratios admission / unbounded. Recorded in docs/reliability.md.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml
from baton.services.launcher.ports import free_port
from common import REPO, bench_model

BATON = Path(sys.executable).parent / "baton"
LOAD = ("--input-len", "64", "--output-len", "64")
OVERLOAD_S = 20
ARMS = {"admission": 1.0, "unbounded": None}


def config(path: Path, http_port: int, max_queue_delay_s: float | None) -> Path:
    config = yaml.safe_load((REPO / "configs" / "local-colocated.yaml").read_text())
    config["server"].update(http_host="127.0.0.1", http_port=http_port, grpc_port=free_port())
    config["engine"]["model"].update(served_model_name="bench", max_model_len=1024)
    config["engine"]["scheduler"].update(max_num_seqs=16)
    config["colocated"]["max_queue_delay_s"] = max_queue_delay_s
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def bench(url: str, out: Path, *args: str) -> dict:
    cmd = [str(BATON), "bench", "run", "--backend", "openai", "--address", url, "--model", "bench"]
    cmd += ["--tokenizer", str(bench_model()), "--temperature", "0", "--seed", "7", "--no-plots", "--no-progress"]
    cmd += ["--slo-ttft-ms", "2000", "--slo-tpot-ms", "200", "--out", str(out), *LOAD, *args]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "result.json").read_text())["runs"][0]["metrics"]


def arm(name: str, max_queue_delay_s: float | None, run_dir: Path) -> dict:
    port = free_port()
    cfg = config(run_dir / f"{name}.yaml", port, max_queue_delay_s)
    cmd = [str(BATON), "serve", "--config", str(cfg), "--model", str(bench_model()), "--grace-period", "5"]
    with open(run_dir / f"{name}-server.log", "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None and time.monotonic() < deadline, f"{name} did not start; see its log"
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=5):
                    break
            except OSError:
                time.sleep(1)
        bench(url, run_dir / f"{name}-warmup", "--concurrency", "8", "--num-requests", "16")
        capacity = bench(url, run_dir / f"{name}-capacity", "--concurrency", "16", "--num-requests", "96")
        rate = 3 * capacity["request_throughput"]
        metrics = bench(
            url, run_dir / f"{name}-overload", "--rate", f"{rate:.2f}", "--num-requests", str(int(rate * OVERLOAD_S))
        )
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    return {"capacity": capacity["request_throughput"], "rate": rate, **metrics}


def main() -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="baton-overload-"))
    results = {name: arm(name, delay, run_dir) for name, delay in ARMS.items()}
    print(
        f"{'arm':<10} {'cap req/s':>9} {'offered':>8} {'sent':>5} {'done':>5} {'shed':>5} "
        f"{'TTFT p50':>9} {'p90':>7} {'p99':>7} {'goodput':>8}"
    )
    for name, r in results.items():
        ttft = r["ttft_ms"]
        print(
            f"{name:<10} {r['capacity']:>9.2f} {r['rate']:>8.2f} {r['num_requests']:>5} {r['num_completed']:>5} "
            f"{r['num_failed']:>5} {ttft['p50'] / 1000:>8.2f}s {ttft['p90'] / 1000:>6.2f}s {ttft['p99'] / 1000:>6.2f}s "
            f"{r['goodput']:>8.2f}"
        )
    a, u = results["admission"], results["unbounded"]
    print(
        f"admission / unbounded: TTFT p90 {a['ttft_ms']['p90'] / u['ttft_ms']['p90']:.2f}x, "
        f"p99 {a['ttft_ms']['p99'] / u['ttft_ms']['p99']:.2f}x, goodput {a['goodput'] / max(u['goodput'], 1e-9):.2f}x"
    )
    print(f"(logs and results in {run_dir})")


if __name__ == "__main__":
    main()
