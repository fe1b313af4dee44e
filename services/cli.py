"""The `baton` command line.

baton serve [--config F] [--model DIR] [--http-port N ...] [--set section.key=value ...]   run it here
baton generate "prompt" [--address HOST:PORT | --config F] [--max-tokens N ...]   stream over gRPC
baton status [--address HOST:PORT | --config F]          model, health, replicas, KV usage, router
baton make-tiny-model DIR [--arch llama|qwen3]            write a small random model
baton bench run|compare ...                               load-test a server; compare result files

Clients find the server the same way: `--address`, else `BATON_ADDRESS`, else the ports of
`--config` (or `BATON_CONFIG`, the file `baton serve` was started with), else the defaults
(gRPC 127.0.0.1:9000, HTTP 8000, metrics 8080). They send an API key when given one:
`--api-key`, else `BATON_API_KEY` (the environment keeps it out of `ps`).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from .client_tls import ClientTLS, add_tls_arguments
from .launcher.console_logging import DEFAULT_LEVEL, LEVELS

# `baton serve` flag -> the key of the config's `server` section it sets
SERVE_FLAGS = {"host": "http_host", "http_port": "http_port", "grpc_port": "grpc_port", "metrics_port": "metrics_port"}


@dataclass(frozen=True, slots=True)
class ServerAddress:
    """Where a client reaches a running Baton."""

    grpc: str  # host:port
    http: str  # base URL, without /v1
    metrics: str  # Prometheus URL
    application: str  # Serve application name (gRPC `application` metadata)
    config_path: str | None = None  # the config the ports came from, if any


def find_server(address: str | None, config_path: str | None, application: str | None = None) -> ServerAddress:
    """`address`, else BATON_ADDRESS, else the config's ports (`config_path`, else BATON_CONFIG),
    else the defaults. A config's wildcard HTTP host (0.0.0.0, ::) is dialled on loopback."""
    from .config import ServerConfig, read_config_file

    config_path = config_path or os.environ.get("BATON_CONFIG") or None
    raw = read_config_file(config_path) if config_path else {}
    server = ServerConfig.model_validate(raw.get("server") or {})
    http_host = "127.0.0.1" if server.http_host in ("0.0.0.0", "::", "") else server.http_host
    grpc = address or os.environ.get("BATON_ADDRESS") or f"{http_host}:{server.grpc_port}"
    grpc_host = grpc.rsplit(":", 1)[0]
    return ServerAddress(
        grpc=grpc,
        http=f"http://{http_host}:{server.http_port}",
        metrics=f"http://{grpc_host}:{server.metrics_port}/metrics",
        application=application or raw.get("name") or "baton",
        config_path=config_path,
    )


def _make_tiny_model(args: argparse.Namespace) -> int:
    from .model.tiny import make_tiny_model

    overrides = {}
    if args.num_kv_heads is not None:
        overrides["num_key_value_heads"] = args.num_kv_heads
    path = make_tiny_model(args.dir, arch=args.arch, preset=args.preset, seed=args.seed, **overrides)
    print(f"wrote a random {args.arch} model ({args.preset}) to {path}")
    return 0


def serve_overrides(args: argparse.Namespace) -> dict:
    """The `--set` assignments, then the flags (a flag wins over a `--set` of the same key)."""
    from .config import config_overrides

    overrides = config_overrides(args.set)
    flags = {key: getattr(args, flag) for flag, key in SERVE_FLAGS.items() if getattr(args, flag) is not None}
    if flags:
        overrides["server"] = {**overrides.get("server", {}), **flags}
    return overrides


def _serve(args: argparse.Namespace) -> int:
    try:
        overrides = serve_overrides(args)
    except ValueError as e:
        print(f"baton serve: error: {e}", file=sys.stderr)
        return 2
    from .launcher.serve_command import serve_forever

    return serve_forever(args.config, args.model, args.grace_period, overrides, args.log_level, args.redis_acl)


def _client_server(args: argparse.Namespace) -> ServerAddress | None:
    try:
        return find_server(args.address, args.config, args.application)
    except ValueError as e:
        print(f"baton {args.command}: error: {e}", file=sys.stderr)
        return None


def _generate(args: argparse.Namespace) -> int:
    from .client import generate_to_terminal

    server = _client_server(args)
    if server is None:
        return 2
    args.address, args.application = server.grpc, server.application
    return generate_to_terminal(args)


def _status(args: argparse.Namespace) -> int:
    from .client import print_status

    server = _client_server(args)
    if server is None:
        return 2
    metrics_url = args.metrics_address or server.metrics
    try:
        tls = ClientTLS.from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return print_status(server.grpc, server.application, metrics_url, args.timeout, args.api_key, tls)


def _bench(args: argparse.Namespace) -> int:
    from .loadtest.cli import main as bench_main

    if getattr(args, "bench_command", None) == "run" and args.address is None:
        try:
            server = find_server(None, args.config, args.application)
        except ValueError as e:
            print(f"baton bench: error: {e}", file=sys.stderr)
            return 2
        args.address = server.grpc if args.backend == "grpc" else server.http
    return bench_main(args)


def _add_client_arguments(parser: argparse.ArgumentParser, application_default: str | None = None) -> None:
    where = parser.add_argument_group("server (--address, else $BATON_ADDRESS, else the ports of --config)")
    where.add_argument("--address", default=None, help="gRPC host:port (default: 127.0.0.1:9000)")
    where.add_argument(
        "--config", default=None, help="the YAML `baton serve` runs with: its ports and name (default: $BATON_CONFIG)"
    )
    where.add_argument(
        "--application", default=application_default, help="Serve application name (default: the config's, baton)"
    )
    where.add_argument("--api-key", default=None, help="API key, sent as a bearer token (default: $BATON_API_KEY)")
    add_tls_arguments(where)


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="start Ray, Redis and the Baton application on this machine",
        description="Start a local Ray, a local Redis (unless the config names one) and the application. "
        "Flags override the config file; --set overrides any config key.",
    )
    config = serve.add_argument_group("config")
    config.add_argument("--config", default=None, help="YAML config (default: $BATON_CONFIG, else configs/local.yaml)")
    config.add_argument("--model", default=None, help="model folder (default: the config's, else a tiny random model)")
    config.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config key (repeatable), the value read as YAML: --set colocated.num_replicas=2",
    )
    network = serve.add_argument_group("network (flags win over the config and --set)")
    network.add_argument("--host", default=None, help="HTTP listen address (server.http_host; default 127.0.0.1)")
    network.add_argument("--http-port", type=int, default=None, help="OpenAI HTTP port (server.http_port; 8000)")
    network.add_argument(
        "--grpc-port", type=int, default=None, help="gRPC port, on server.grpc_host (server.grpc_port; 9000)"
    )
    network.add_argument(
        "--metrics-port", type=int, default=None, help="Prometheus port (server.metrics_port; 8080; 0: a free one)"
    )
    run = serve.add_argument_group("running")
    security = serve.add_argument_group("security (TLS on the APIs: server.tls)")
    security.add_argument(
        "--redis-acl",
        action="store_true",
        help="the local Redis gets an ACL user `baton` with a generated password (the default user off)",
    )
    run.add_argument(
        "--grace-period",
        type=float,
        default=None,
        help="seconds in-flight requests get to finish on SIGTERM/SIGINT/SIGHUP (default 20; a second signal: at once)",
    )
    run.add_argument(
        "--log-level",
        choices=LEVELS,
        default=DEFAULT_LEVEL,
        help="what the console shows from Baton, Ray and Serve (default warning; the run folder's baton.log "
        "keeps info and up)",
    )
    serve.set_defaults(func=_serve)


def _add_generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="stream a completion from a running Baton over gRPC")
    gen.add_argument("prompt")
    _add_client_arguments(gen)
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=64)
    sampling.add_argument("--temperature", type=float, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--seed", type=int, default=None)
    sampling.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--timeout", type=float, default=60.0, help="deadline in seconds")
    gen.set_defaults(func=_generate)


def _add_status_parser(sub) -> None:
    status = sub.add_parser("status", help="a running Baton's model, health, replicas, KV usage and router")
    _add_client_arguments(status)
    status.add_argument(
        "--metrics-address", default=None, help="Prometheus URL (default: the gRPC host, server.metrics_port)"
    )
    status.add_argument("--timeout", type=float, default=10.0, help="seconds for each call")
    status.set_defaults(func=_status)


def _add_bench_parser(sub) -> None:
    from .loadtest.cli import add_bench_arguments  # argparse only: cheap

    bench = sub.add_parser("bench", help="load-test Baton (gRPC) or any OpenAI-compatible server; compare results")
    add_bench_arguments(bench)
    # `bench run` finds the server as the other clients do: its --address, else BATON_ADDRESS or --config.
    run = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices["run"]
    run.add_argument("--config", default=None, help="the YAML `baton serve` runs with: its ports; else $BATON_CONFIG")
    bench.set_defaults(func=_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Baton: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(sub)
    _add_generate_parser(sub)
    _add_status_parser(sub)

    tiny = sub.add_parser("make-tiny-model", help="write a small random model with a trained tokenizer")
    tiny.add_argument("dir", help="output folder")
    tiny.add_argument("--arch", choices=["llama", "qwen3", "qwen2", "mistral"], default="llama")
    tiny.add_argument("--preset", choices=["tiny", "bench"], default="tiny")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--num-kv-heads", type=int, default=None)
    tiny.set_defaults(func=_make_tiny_model)

    _add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
