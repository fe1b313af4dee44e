"""`python bench/peer_vllm.py serving`: `baton serve` vs `vllm serve`, one server at a time.

Baton: a generated copy of configs/local-colocated.yaml with the changes in the notes on
the comparison (one colocated replica with num_cpus 2 and 2 engine threads, 16,384 KV blocks
= vLLM's 4 GiB, prefix caching on, max_num_seqs 64, 2048-token steps, max_model_len 2048).
vLLM: `vllm serve` (through bench/peer_vllm_worker.py's version shim) with the same limits
and its documented CPU settings. Both listen on 127.0.0.1 only, on free ports.

Each server, in turn: start in a session of its own, wait for 200 on /v1/models (the
start-up time), one warm-up load, then every load below with the same
`baton bench run --backend openai` command (the same seeds for both servers in a round, one
seed per load), stop (SIGTERM to the server's PID, then whatever is left in its session, by
PID). The order of the servers alternates per round. A load during which the rest of the
machine used QUIET_CORES or more is run once more. Ratios are Baton / vLLM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from statistics import mean, median
from typing import Any

import yaml
from baton.services.launcher.ports import free_port
from common import REPO, bench_model, pick
from peer_vllm import OUT, QUIET_CORES, VPY, WORKER, kill_session, load1, vllm_env
from peer_vllm_worker import busy_jiffies, session_cpu

BATON = Path(sys.executable).parent / "baton"
MODEL_NAME = "bench"
LIMITS = {"max_model_len": 2048, "max_num_seqs": 64, "max_num_batched_tokens": 2048}


@dataclass(frozen=True)
class Load:
    key: str  # for --loads
    name: str
    args: tuple[str, ...]
    num_requests: int  # full round
    quick_requests: int


# The loads of the performance issue's table. Counts keep one round of both servers near 12 min.
LOADS = (
    Load("rate1", "random 256->128, 1 req/s", ("--input-len", "256", "--output-len", "128", "--rate", "1"), 90, 8),
    Load("rate3", "random 256->128, 3 req/s", ("--input-len", "256", "--output-len", "128", "--rate", "3"), 150, 12),
    Load(
        "prefix",
        "shared prefix 8x1024+64->32, 2 req/s",
        ("--workload", "shared-prefix", "--num-groups", "8", "--prefix-len", "1024", "--suffix-len", "64")
        + ("--output-len", "32", "--rate", "2"),
        120,
        12,
    ),
    Load(
        "c16", "concurrency 16, 128->256", ("--input-len", "128", "--output-len", "256", "--concurrency", "16"), 64, 16
    ),
)
WARMUP = Load("warmup", "warm-up", ("--input-len", "128", "--output-len", "32", "--concurrency", "8"), 16, 8)

# (label, path in the result's metrics, higher is better)
METRICS = (
    ("out tok/s", ("output_token_throughput",), True),
    ("TTFT p50", ("ttft_ms", "p50"), False),
    ("TTFT p90", ("ttft_ms", "p90"), False),
    ("TPOT p50", ("tpot_ms", "p50"), False),
    ("TPOT p90", ("tpot_ms", "p90"), False),
    ("goodput", ("goodput",), True),
)


def baton_config(path: Path, http_port: int, stream_interval: int = 1, direct_ingress: bool | None = None) -> Path:
    config = yaml.safe_load((REPO / "configs" / "local-colocated.yaml").read_text())
    config["server"].update(http_host="127.0.0.1", http_port=http_port, grpc_port=free_port())
    if direct_ingress is not None:  # None: the default, `auto` (the gateway replica serves the port)
        config["server"]["direct_ingress"] = direct_ingress
    engine = config["engine"]
    engine["model"].update(served_model_name=MODEL_NAME, max_model_len=LIMITS["max_model_len"])
    engine["cache"].update(num_kv_blocks=16384, enable_prefix_caching=True)
    engine["scheduler"].update(
        max_num_seqs=LIMITS["max_num_seqs"], max_num_batched_tokens=2048, stream_interval=stream_interval
    )
    engine["runner"] = {"num_threads": 2}
    config["colocated"]["ray_actor_options"] = {"num_cpus": 2}
    config.setdefault("gateway", {})["multiplex_outputs"] = True  # output channels (bench/output_channels.py)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def server_command(
    server: str,
    port: int,
    run_dir: Path,
    stream_interval: int = 1,
    direct_ingress: bool | None = None,
    baton_sets: tuple[str, ...] = (),
    baton_env: dict[str, str] | None = None,
) -> tuple[list[str], dict[str, str] | None]:
    """`baton_sets`: `--set key=value` overrides for Baton's config; `baton_env`: variables
    added to Baton's environment (both for bench/serving_ab.py)."""
    model = str(bench_model())
    if server == "baton":
        config = baton_config(run_dir / "baton.yaml", port, stream_interval, direct_ingress)
        sets = [arg for kv in baton_sets for arg in ("--set", kv)]
        env = {**os.environ, **baton_env} if baton_env else None
        return [str(BATON), "serve", "--config", str(config), "--model", model, "--grace-period", "5", *sets], env
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in LIMITS.items()]
    cmd = [str(VPY), str(WORKER), "serve", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    cmd += [
        *flags,
        "--served-model-name",
        MODEL_NAME,
        "--enable-prefix-caching",
        f"--stream-interval={stream_interval}",
    ]
    return [*cmd, "--enable-prompt-tokens-details"], vllm_env()  # cached tokens in usage, as Baton


class Server:
    """One server process in a session of its own (so every process it starts can be found)."""

    def __init__(
        self,
        name: str,
        run_dir: Path,
        stream_interval: int = 1,
        direct_ingress: bool | None = None,
        baton_sets: tuple[str, ...] = (),
        baton_env: dict[str, str] | None = None,
    ) -> None:
        self.name, self.port = name, free_port()
        cmd, env = server_command(name, self.port, run_dir, stream_interval, direct_ingress, baton_sets, baton_env)
        run_dir.mkdir(parents=True, exist_ok=True)  # a round that starts with vLLM has no Baton config there yet
        self.log = run_dir / f"{name}-server.log"
        self._log = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        """Seconds from the start to the first 200 on /v1/models."""
        deadline = self.started + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - self.started
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                print(f"  {self.name} did not stop within 60 s of SIGTERM: killing its session", flush=True)
        kill_session(self.proc.pid)
        self.proc.wait()
        self._log.close()


def bench_command(server: Server, load: Load, n: int, seed: int, out: Path) -> list[str]:
    cmd = [str(BATON), "bench", "run", "--backend", "openai", "--address", server.url, "--model", MODEL_NAME]
    cmd += ["--tokenizer", str(bench_model()), "--temperature", "0", "--num-requests", str(n), "--seed", str(seed)]
    cmd += ["--slo-ttft-ms", "1000", "--slo-tpot-ms", "100", "--out", str(out), "--no-plots", "--no-progress"]
    return [*cmd, "--label", f"{server.name}-{load.name}", *load.args]


def bench_run(server: Server, load: Load, n: int, seed: int, out: Path) -> dict[str, Any]:
    """One `baton bench run` against `server`: the run's metrics and host load, and the
    cores used meanwhile by the server (its whole session), the client, and the rest of the
    machine (the noise)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    busy0, total0 = busy_jiffies()
    server0 = sum(session_cpu(server.proc.pid).values())
    start = time.monotonic()
    with open(out.with_suffix(".log"), "w") as log:
        client = subprocess.Popen(bench_command(server, load, n, seed, out), stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(client.pid, 0)
        client.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - start
    server_s = sum(session_cpu(server.proc.pid).values()) - server0
    busy1, total1 = busy_jiffies()
    if client.returncode != 0:
        raise RuntimeError(f"baton bench run exited {client.returncode}; see {out.with_suffix('.log')}")
    run = json.loads((out / "result.json").read_text())["runs"][0]
    busy = (busy1 - busy0) / max(total1 - total0, 1) * (os.cpu_count() or 1)
    cores = {"server": server_s / wall, "client": (usage.ru_utime + usage.ru_stime) / wall}
    cores["others"] = max(busy - cores["server"] - cores["client"], 0.0)
    return {"metrics": run["metrics"], "host": run["host"], "cores": cores, "wall_s": wall}


def load_with_retry(server: Server, load: Load, n: int, seed: int, out: Path) -> dict[str, Any]:
    """bench_run, once more if the rest of the machine used QUIET_CORES or more meanwhile
    (the noisy result is kept under "noisy")."""
    result = bench_run(server, load, n, seed, out)
    if result["cores"]["others"] >= QUIET_CORES:
        print(f"    noisy (others used {result['cores']['others']:.2f} cores): again", flush=True)
        noisy = result
        result = bench_run(server, load, n, seed, out.with_name(out.name + "-again"))
        result["noisy"] = noisy
    return result


def serve_and_load(
    name: str,
    round_dir: Path,
    quick: bool,
    seed: int,
    stream_interval: int = 1,
    direct_ingress: bool | None = None,
    baton_sets: tuple[str, ...] = (),
    baton_env: dict[str, str] | None = None,
    loads: tuple[Load, ...] = LOADS,
) -> dict[str, Any]:
    print(f"  starting {name} (load {load1():.2f}) ...", flush=True)
    direct = direct_ingress if name == "baton" else None
    server = Server(name, round_dir, stream_interval, direct, baton_sets, baton_env)
    try:
        ready_s = server.wait_ready()
        print(f"  {name} ready in {ready_s:.1f} s on {server.url}", flush=True)
        warmup_n = WARMUP.quick_requests if quick else WARMUP.num_requests
        bench_run(server, WARMUP, warmup_n, seed + len(LOADS), round_dir / name / "warmup")
        results = {}
        for load in loads:
            i = LOADS.index(load)  # a load's seed and folder stay the same when it runs alone
            n = load.quick_requests if quick else load.num_requests
            print(f"  {name}: {load.name}, {n} requests (load {load1():.2f}) ...", flush=True)
            # a seed per load: random prompts of one seed share their leading tokens across
            # lengths, so one seed for all would let each load hit the cache of the one before
            results[load.name] = load_with_retry(server, load, n, seed + i, round_dir / name / f"load{i}")
    finally:
        server.stop()
    return {"ready_s": ready_s, "loads": results}


def value(result: dict[str, Any], path: tuple[str, ...]) -> float | None:
    v: Any = result["metrics"]
    for key in path:
        v = v.get(key) if v is not None else None
    return v


def ratio(b: float | None, v: float | None) -> str:
    if b is None or v is None or v == 0:
        return "  n/a"
    return f"{b / v:5.2f}x"


def print_round(index: int, results: dict[str, dict[str, Any]], loads: tuple[Load, ...] = LOADS) -> None:
    print(f"\nround {index + 1}: start-up (first 200 on /v1/models) ", end="")
    print(", ".join(f"{s} {r['ready_s']:.1f} s" for s, r in results.items()))
    head = "".join(f"{label:>11}" for label, _, _ in METRICS)
    print(f"{'load':38} {'server':6}{head}  cached  done/sent  load1 start/end  cores: server client others")
    for load in loads:
        for server in ("baton", "vllm"):
            r = results[server]["loads"][load.name]
            cells = "".join(f"{value(r, path) or 0:11.1f}" for _, path, _ in METRICS)
            m, h, c = r["metrics"], r["host"], r["cores"]
            label = server + ("*" if "noisy" in r else "")  # *: a noisy first try was repeated
            cached = f"{(m['cached_token_ratio'] or 0) * 100:5.1f}%"
            print(
                f"{load.name if server == 'baton' else '':38} {label:6}{cells}  {cached}   {m['num_completed']:4}/{m['num_requests']:<4}"
                f"  {h['loadavg_1m_start']:5.2f} / {h['loadavg_1m_end']:5.2f}          {c['server']:5.2f}"
                f"  {c['client']:5.2f}  {c['others']:5.2f}"
            )
        b, v = results["baton"]["loads"][load.name], results["vllm"]["loads"][load.name]
        cells = "".join(f"{ratio(value(b, p), value(v, p)):>11}" for _, p, _ in METRICS)
        print(f"{'':38} {'B/V':6}{cells}")


def summary(
    rounds: list[dict[str, dict[str, Any]]], loads: tuple[Load, ...] = LOADS
) -> dict[str, dict[str, list[float | None]]]:
    """Per load and metric, the Baton / vLLM ratio of each round."""
    out: dict[str, dict[str, list[float | None]]] = {}
    for load in loads:
        out[load.name] = {}
        for label, path, _ in METRICS:
            ratios = []
            for rnd in rounds:
                b, v = value(rnd["baton"]["loads"][load.name], path), value(rnd["vllm"]["loads"][load.name], path)
                ratios.append(None if b is None or not v else b / v)
            out[load.name][label] = ratios
    return out


def median_ratio(xs: list[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return median(known) if known else None


def print_summary(ratios: dict[str, dict[str, list[float | None]]]) -> None:
    print("\nBaton / vLLM per load (one number per round; throughput and goodput: higher is better for Baton)")
    for load, by_metric in ratios.items():
        cells = "  ".join(
            f"{label} " + "/".join("n/a" if x is None else f"{x:.2f}" for x in xs) for label, xs in by_metric.items()
        )
        print(f"  {load:38} {cells}")
    num_rounds = max((len(xs) for by_metric in ratios.values() for xs in by_metric.values()), default=0)
    if num_rounds < 2:
        return
    # one round's ratio moves by +-20% on a shared host: the median over rounds is the result
    print("Median over rounds")
    for load, by_metric in ratios.items():
        cells = "  ".join(
            f"{label} " + ("n/a" if (m := median_ratio(xs)) is None else f"{m:.2f}x") for label, xs in by_metric.items()
        )
        print(f"  {load:38} {cells}")


def selected_loads(keys: str | None) -> tuple[Load, ...]:
    """`--loads rate1,c16`: those loads, in the table's order; None: all of them."""
    wanted = pick("--loads", keys, tuple(load.key for load in LOADS))
    return tuple(load for load in LOADS if load.key in wanted)


def run_serving(args, save) -> None:
    loads = selected_loads(args.loads)
    started = time.strftime("%Y%m%d-%H%M%S")
    rounds = []
    for i in range(args.rounds):
        round_dir = OUT / f"serving-{started}" / f"round{i + 1}"
        order = ("baton", "vllm") if i % 2 == 0 else ("vllm", "baton")
        seed = 31 + 10 * i
        print(f"round {i + 1}/{args.rounds}: {' then '.join(order)}, seeds {seed}-{seed + len(LOADS)}", flush=True)
        rounds.append(
            {
                name: serve_and_load(
                    name, round_dir, args.quick, seed, args.stream_interval, args.direct_ingress, loads=loads
                )
                for name in order
            }
        )
        print_round(i, rounds[-1], loads)
    ratios = summary(rounds, loads)
    print_summary(ratios)
    ready = {s: mean(r[s]["ready_s"] for r in rounds) for s in ("baton", "vllm")}
    print(f"  start-up: Baton {ready['baton']:.1f} s, vLLM {ready['vllm']:.1f} s")
    print(f"wrote {save('serving', {'rounds': rounds, 'ratios': ratios})}")
