"""`baton` command line: make-tiny-model (and, as they land, serve, generate, bench)."""

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Baton: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("make-tiny-model", help="write a small random model with a trained tokenizer")
    tiny.add_argument("dir", help="output folder")
    tiny.add_argument("--arch", choices=["llama", "qwen3"], default="llama")
    tiny.add_argument("--preset", choices=["tiny", "bench"], default="tiny")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--num-kv-heads", type=int, default=None)
    tiny.set_defaults(func=_make_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
