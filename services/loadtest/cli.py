"""`baton bench run` and `baton bench compare`: the harness's command line.

    baton bench run [--backend grpc|openai] [--address ...] [--workload random|shared-prefix|multi-turn|sharegpt]
                    [--rate R[,R...] | --concurrency N[,N...]] [--num-requests N] [--duration S] [--out DIR]
    baton bench compare A.json B.json [...] [--labels a,b] [--out DIR]

`run` writes DIR/result.json and the PNG plots and prints the summary table; `compare`
prints a side-by-side table and writes DIR/compare.png. Bad input is reported as one line
("baton bench: error: ...", exit status 2) before any load is sent. Only argparse is
imported at module level: `baton --help` stays fast.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from ..client_tls import ClientTLS, add_tls_arguments  # argparse and ssl only: cheap

WORKLOADS = ("random", "shared-prefix", "multi-turn", "sharegpt")
DEFAULT_ADDRESS = {"grpc": "127.0.0.1:9000", "openai": "http://127.0.0.1:8000"}
DEFAULT_NUM_REQUESTS = 100


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `run` and `compare` under `parser` (the `bench` subcommand's parser)."""
    sub = parser.add_subparsers(dest="bench_command", required=True)
    run = sub.add_parser(
        "run",
        help="load-test a running server and write a result file, plots and a summary",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_run_arguments(run)
    run.set_defaults(bench_func=_run)

    compare = sub.add_parser("compare", help="put two or more result files side by side (table + plot)")
    compare.add_argument("results", nargs="+", help="result.json files of `baton bench run`")
    compare.add_argument("--labels", default=None, help="comma-separated column labels (default: each file's label)")
    compare.add_argument("--out", default=".", help="folder for compare.png")
    compare.add_argument("--no-plot", action="store_true", help="print the table only")
    compare.set_defaults(bench_func=_compare)


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    server = p.add_argument_group("server")
    server.add_argument("--backend", choices=("grpc", "openai"), default="grpc", help="Baton gRPC, or OpenAI HTTP")
    server.add_argument(
        "--address", default=None, help="gRPC host:port, or HTTP base URL (default: Baton's local ports)"
    )
    server.add_argument("--application", default="baton", help="gRPC: the Serve application name")
    server.add_argument("--model", default=None, help="expected served model name (default: the server's)")
    server.add_argument("--endpoint", choices=("completions", "chat"), default="completions", help="HTTP endpoint")
    server.add_argument(
        "--api-key",
        default=None,
        help="API key, sent as a bearer token (default: $BATON_API_KEY; HTTP: else $OPENAI_API_KEY)",
    )
    add_tls_arguments(server)
    server.add_argument("--tokenizer", default=None, help="local tokenizer folder (HTTP: token counts, decoding)")
    server.add_argument("--vocab-size", type=int, default=None, help="random token ids are below this")

    work = p.add_argument_group("workload (lengths: N, uniform:LOW:HIGH or normal:MEAN:STD)")
    work.add_argument("--workload", choices=WORKLOADS, default="random")
    work.add_argument("--input-len", default="128", help="random: prompt length")
    work.add_argument("--output-len", default=None, help="output length (default 32; sharegpt: the reply's length)")
    work.add_argument(
        "--class",
        dest="classes",
        action="append",
        default=[],
        metavar="NAME,WEIGHT,IN,OUT",
        help="random: a request class of a mix (repeatable), e.g. long,0.3,uniform:900:1100,16",
    )
    work.add_argument("--num-groups", type=int, default=8, help="shared-prefix: prefix groups")
    work.add_argument("--prefix-len", default="256", help="shared-prefix: prefix length")
    work.add_argument("--suffix-len", default="32", help="shared-prefix: unique suffix length")
    work.add_argument("--popularity", default="uniform", help="shared-prefix: uniform or zipf[:S]")
    work.add_argument("--turns", type=int, default=3, help="multi-turn: turns per conversation")
    work.add_argument("--first-turn-len", default="128", help="multi-turn: first prompt length")
    work.add_argument("--turn-len", default="32", help="multi-turn: new tokens per later turn")
    work.add_argument("--think-time-ms", type=float, default=0.0, help="multi-turn: pause before each later turn")
    work.add_argument("--dataset", default=None, help="sharegpt: path of a ShareGPT-format JSON file")

    load = p.add_argument_group("load")
    load.add_argument("--rate", default="inf", help="arrivals per second; a comma list is a sweep; inf: all at once")
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson, <1: burstier)"
    )
    load.add_argument("--concurrency", default=None, help="closed loop: N requests in flight (comma list: a sweep)")
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight at any rate")
    load.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help=f"requests per run (default {DEFAULT_NUM_REQUESTS} without --duration)",
    )
    load.add_argument("--duration", type=float, default=None, help="seconds per run after which no request starts")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--warmup", type=int, default=1, help="warm-up requests first (0: none, and no pre-flight)")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--no-ignore-eos", action="store_true", help="let EOS end outputs early (lengths become inexact)")
    load.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    load.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to reach the server")

    slo = p.add_argument_group("SLO (goodput counts requests meeting all that are set)")
    slo.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    slo.add_argument("--slo-tpot-ms", type=float, default=100.0)
    slo.add_argument("--slo-e2e-ms", type=float, default=None)

    out = p.add_argument_group("output")
    out.add_argument("--out", default=None, help="result folder (default: bench-results/LABEL-TIME)")
    out.add_argument("--label", default=None, help="name of this configuration in tables and plots")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    """Runs the parsed `bench` subcommand; bad input is one line on stderr and status 2."""
    from .errors import BenchInputError

    try:
        return args.bench_func(args)
    except BenchInputError as e:
        print(f"baton bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nbaton bench: interrupted; no result written", file=sys.stderr)
        return 130


def main_argv(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton bench", description="Load-test harness")
    add_bench_arguments(parser)
    return main(parser.parse_args(argv))


# -- run ---------------------------------------------------------------------------------------


def build_spec(args: argparse.Namespace):
    """The BenchmarkSpec the arguments describe (every check that needs no server)."""
    from .backends.base import SamplingOptions
    from .benchmark import BenchmarkSpec
    from .metrics import Slo
    from .runner import Bounds

    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = DEFAULT_NUM_REQUESTS
    return BenchmarkSpec(
        workload=build_workload(args),
        loads=build_loads(args),
        bounds=Bounds(num_requests, args.duration),
        backend=args.backend,
        address=args.address or DEFAULT_ADDRESS[args.backend],
        model=args.model,
        application=args.application,
        endpoint=args.endpoint,
        api_key=api_key(args.api_key, args.backend),
        tls=ClientTLS.from_args(args),
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        sampling=SamplingOptions(args.temperature, not args.no_ignore_eos),
        slo=Slo(*(None if v is None else v / 1000.0 for v in (args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms))),
        seed=args.seed,
        warmup=args.warmup,
        request_timeout_s=args.request_timeout,
        connect_timeout_s=args.connect_timeout,
        label=args.label or f"{args.backend}-{args.workload}",
        progress=not args.no_progress,
    )


def build_workload(args: argparse.Namespace):
    from .errors import BenchInputError
    from .lengths import LengthDistribution as L

    output_len = args.output_len or "32"
    if args.workload == "random":
        from .workloads.random import RandomWorkload, RequestClass

        classes = [RequestClass.parse(c) for c in args.classes] or [
            RequestClass("random", 1.0, L.parse(args.input_len), L.parse(output_len))
        ]
        return RandomWorkload(classes)
    if args.workload == "shared-prefix":
        from .workloads.shared_prefix import SharedPrefixWorkload

        return SharedPrefixWorkload(
            args.num_groups, L.parse(args.prefix_len), L.parse(args.suffix_len), L.parse(output_len), args.popularity
        )
    if args.workload == "multi-turn":
        from .workloads.multi_turn import MultiTurnWorkload

        return MultiTurnWorkload(
            args.turns,
            L.parse(args.first_turn_len),
            L.parse(args.turn_len),
            L.parse(output_len),
            args.think_time_ms / 1000,
        )
    from .workloads.sharegpt import ShareGPTWorkload

    if not args.dataset:
        raise BenchInputError("the sharegpt workload needs --dataset PATH (a ShareGPT-format JSON file)")
    fixed = None
    if args.output_len is not None:
        try:
            fixed = int(args.output_len)
        except ValueError as e:
            raise BenchInputError(f"sharegpt: --output-len must be a number, got {args.output_len!r}") from e
    return ShareGPTWorkload(args.dataset, fixed)


def _numbers(text: str, kind, what: str) -> list:
    from .errors import BenchInputError

    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise BenchInputError(f"{what}: expected a comma-separated list of numbers, got {text!r}") from e


def build_loads(args: argparse.Namespace):
    from .errors import BenchInputError
    from .runner import LoadSpec

    if args.concurrency is not None:
        if args.rate != "inf":
            raise BenchInputError("give --rate or --concurrency, not both (use --max-concurrency to cap a rate)")
        return [LoadSpec(math.inf, args.burstiness, c) for c in _numbers(args.concurrency, int, "--concurrency")]
    rates = _numbers(args.rate, float, "--rate")
    if not rates:
        raise BenchInputError("--rate: no rate given")
    return [LoadSpec(r, args.burstiness, args.max_concurrency) for r in rates]


def _run(args: argparse.Namespace) -> int:
    from .benchmark import run_benchmark_sync
    from .report import format_summary, write_result

    spec = build_spec(args)
    out_dir = Path(args.out or Path("bench-results") / f"{spec.label}-{time.strftime('%Y%m%d-%H%M%S')}")
    result = run_benchmark_sync(spec)
    paths = [write_result(result, out_dir / "result.json")]
    if not args.no_plots:
        from .plots import write_run_plots

        paths += write_run_plots(result, out_dir)
    print(format_summary(result))
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0


def api_key(flag: str | None, backend: str) -> str | None:
    """--api-key, else $BATON_API_KEY, else (HTTP only, for other OpenAI servers) $OPENAI_API_KEY."""
    fallback = os.environ.get("OPENAI_API_KEY") if backend == "openai" else None
    return flag or os.environ.get("BATON_API_KEY") or fallback or None


# -- compare -----------------------------------------------------------------------------------


def _compare(args: argparse.Namespace) -> int:
    from .compare import compare_files

    labels = args.labels.split(",") if args.labels else None
    table, plot = compare_files(args.results, args.out, labels, plot=not args.no_plot)
    print(table)
    if plot is not None:
        print(f"\nwrote {plot}")
    return 0
