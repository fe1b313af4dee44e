"""The `baton` command line.

baton serve [--config configs/local.yaml] [--model DIR] [--grace-period S]   run the service locally
baton generate "prompt" [--max-tokens N ...]              stream a completion over gRPC
baton make-tiny-model DIR [--arch llama|qwen3]            write a small random model
baton bench run|compare ...                               load-test a server; compare result files
"""

from __future__ import annotations

import argparse
import sys


def _make_tiny_model(args: argparse.Namespace) -> int:
    from .model.tiny import make_tiny_model

    overrides = {}
    if args.num_kv_heads is not None:
        overrides["num_key_value_heads"] = args.num_kv_heads
    path = make_tiny_model(args.dir, arch=args.arch, preset=args.preset, seed=args.seed, **overrides)
    print(f"wrote a random {args.arch} model ({args.preset}) to {path}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .launcher.launcher import serve_forever

    return serve_forever(args.config, args.model, args.grace_period)


def _generate(args: argparse.Namespace) -> int:
    from .client import generate_to_terminal

    return generate_to_terminal(args)


def _bench(args: argparse.Namespace) -> int:
    from .loadtest.cli import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Baton: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start Ray, Redis and the Baton application on this machine")
    serve.add_argument("--config", default=None, help="YAML config (default: configs/local.yaml)")
    serve.add_argument("--model", default=None, help="model folder (default: the config's, else a tiny random model)")
    serve.add_argument(
        "--grace-period",
        type=float,
        default=None,
        help="seconds in-flight requests get to finish on SIGTERM/SIGINT/SIGHUP (default 20; a second signal: at once)",
    )
    serve.set_defaults(func=_serve)

    gen = sub.add_parser("generate", help="stream a completion from a running Baton over gRPC")
    gen.add_argument("prompt")
    gen.add_argument("--address", default="127.0.0.1:9000", help="gRPC address (host:port)")
    gen.add_argument("--application", default="baton", help="Serve application name")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--timeout", type=float, default=60.0, help="deadline in seconds")
    gen.set_defaults(func=_generate)

    tiny = sub.add_parser("make-tiny-model", help="write a small random model with a trained tokenizer")
    tiny.add_argument("dir", help="output folder")
    tiny.add_argument("--arch", choices=["llama", "qwen3", "qwen2", "mistral"], default="llama")
    tiny.add_argument("--preset", choices=["tiny", "bench"], default="tiny")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--num-kv-heads", type=int, default=None)
    tiny.set_defaults(func=_make_tiny_model)

    from .loadtest.cli import add_bench_arguments  # argparse only: cheap

    bench = sub.add_parser("bench", help="load-test Baton (gRPC) or any OpenAI-compatible server; compare results")
    add_bench_arguments(bench)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
