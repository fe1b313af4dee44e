"""Shared benchmark pieces: a cached ~30M-parameter random Llama, seeded workloads and a
throwaway Redis. The scripts run as `python bench/<name>.py`, so this folder is on sys.path
and everything else they use is the installed package."""

from __future__ import annotations

import contextlib
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from baton.services.launcher.local_redis import LocalRedis
from baton.services.loadtest.metrics import percentile  # noqa: F401 - re-exported for the engine benchmarks

REPO = Path(__file__).resolve().parents[1]
BENCH_MODELS = REPO / ".baton" / "bench-models"


def bench_model(arch: str = "llama") -> Path:
    """The `bench` preset (hidden 512, 8 layers, GQA 8/4, vocab 8192), built once."""
    from baton.services.model.tiny import make_tiny_model

    path = BENCH_MODELS / f"{arch}-bench"
    if not (path / "model.safetensors").exists():
        make_tiny_model(path, arch=arch, preset="bench")
    return path


@contextlib.contextmanager
def redis_url(url: str | None = None) -> Iterator[str]:
    """`url` when given, else a redis-server of its own on a free loopback port, stopped on exit."""
    if url is not None:
        yield url
        return
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalRedis(Path(tmp))
        try:
            yield server.url
        finally:
            server.stop()


def pick(option: str, keys: str | None, choices: tuple[str, ...]) -> tuple[str, ...]:
    """`option a,b` on a command line: those of `choices`, in their order; None: all of them.
    Exits naming the option and the valid keys on an unknown key or an empty list."""
    if keys is None:
        return choices
    wanted = [k.strip() for k in keys.split(",") if k.strip()]
    unknown = [k for k in wanted if k not in choices]
    if unknown or not wanted:
        raise SystemExit(f"{option}: unknown {', '.join(unknown) or repr(keys)}; choose from {', '.join(choices)}")
    return tuple(c for c in choices if c in wanted)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def mixed_workload(
    num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int, seed: int = 0
) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest(
            [rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range)
        )
        for _ in range(num_requests)
    ]


def num_params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            shape = f.get_slice(name).get_shape()
            count = 1
            for dim in shape:
                count *= dim
            total += count
    return total
