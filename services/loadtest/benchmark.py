"""One benchmark end to end: every check first, then the load, then the result.

    1. the backend (unknown name: error), a local tokenizer if given
    2. probe the server: reachable, serves the model asked for, its context length
    3. the workload against the server: prompt kind, reply token ids, lengths that fit
    4. warm-up requests shaped like the workload's (also a pre-flight: if one fails, nothing
       else is sent)
    5. each load level of the sweep, one after another: the same request shapes and arrival
       pattern (scaled by the rate), its own token ids (seeding.py)
    6. the result dictionary (report.py), with every run's metrics and records

Steps 1-4 raise `BenchInputError` with a message that says what to change; no load has
been sent when they do.
"""

from __future__ import annotations

import asyncio
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from ..client_tls import ClientTLS
from .backends import make_backend
from .backends.base import Backend, BenchRequest, SamplingOptions, ServerInfo
from .errors import BenchInputError
from .metrics import Slo
from .report import result_dict
from .runner import Bounds, LoadRunner, LoadSpec, RunOutcome
from .workloads.base import Workload, WorkloadContext

_SESSIONS_WITHOUT_COUNT = 1000  # sessions a workload prepares for when only a duration bounds the run
WARMUP_RUN = 2**31 - 1  # the run index of warm-up sessions


@dataclass(slots=True)
class BenchmarkSpec:
    workload: Workload
    loads: list[LoadSpec]  # one run per load level (a sweep when several)
    bounds: Bounds  # per run
    backend: str = "grpc"  # grpc | openai
    address: str = "127.0.0.1:9000"  # gRPC host:port, or the HTTP base URL
    model: str | None = None  # None: whatever the server serves
    application: str = "baton"  # gRPC: the Serve application name
    endpoint: str = "completions"  # HTTP: completions | chat
    api_key: str | None = None  # HTTP: sent as a bearer token
    tls: ClientTLS | None = None  # TLS towards the server (its CA; a client certificate for mTLS)
    tokenizer: str | None = None  # a local tokenizer folder (HTTP: counts and decodes; gRPC: optional)
    vocab_size: int | None = None  # random token ids are < this; None: the server's (gRPC) or the tokenizer's
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    slo: Slo = field(default_factory=Slo)
    seed: int = 0
    warmup: int = 1  # warm-up requests before the load (0: none, and no pre-flight)
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    label: str = "bench"
    progress: bool = False  # a progress bar on stderr

    def config(self) -> dict[str, Any]:
        """What the result file records about this benchmark."""
        config: dict[str, Any] = {
            "backend": self.backend,
            "address": self.address,
            "model": self.model,
            "workload": self.workload.describe(),
            "loads": [
                {
                    "rate": None if math.isinf(x.rate) else x.rate,
                    "burstiness": x.burstiness,
                    "max_concurrency": x.max_concurrency,
                }
                for x in self.loads
            ],
            "bounds": asdict(self.bounds),
            "sampling": asdict(self.sampling),
            "seed": self.seed,
            "warmup": self.warmup,
            "request_timeout_s": self.request_timeout_s,
        }
        if self.backend == "grpc":
            config["application"] = self.application
        else:
            config["endpoint"] = self.endpoint
        return config


def run_benchmark_sync(spec: BenchmarkSpec) -> dict[str, Any]:
    return asyncio.run(run_benchmark(spec))


async def run_benchmark(spec: BenchmarkSpec) -> dict[str, Any]:
    if not spec.loads:
        raise BenchInputError("no load level given")
    tokenizer = _load_tokenizer(spec.tokenizer) if spec.tokenizer else None
    backend = make_backend(
        spec.backend,
        spec.address,
        sampling=spec.sampling,
        timeout_s=spec.request_timeout_s,
        connect_timeout_s=spec.connect_timeout_s,
        tokenizer=tokenizer,
        application=spec.application,
        endpoint=spec.endpoint,
        api_key=spec.api_key,
        tls=spec.tls,
    )
    try:
        info = await backend.probe(spec.model)
        await _prepare_workload(spec, backend, info)
        await _warm_up(backend, spec.workload, spec.seed, spec.warmup)
        outcomes = [await _run_load(spec, backend, load, run) for run, load in enumerate(spec.loads)]
    finally:
        await backend.close()
    server = {"model": info.model, "max_context_length": info.max_context_length, "vocab_size": info.vocab_size}
    return result_dict(spec.label, spec.config(), {**server, **info.details}, outcomes, spec.slo)


def _load_tokenizer(path: str):
    from ..engine.api.tokenizer import load_tokenizer
    from ..engine.errors import ModelLoadError

    try:
        return load_tokenizer(path)
    except ModelLoadError as e:
        raise BenchInputError(f"--tokenizer: {e}") from e


async def _prepare_workload(spec: BenchmarkSpec, backend: Backend, info: ServerInfo) -> None:
    workload = spec.workload
    backend.check_prompts(workload.uses_token_ids)
    if workload.needs_reply_token_ids and not backend.returns_reply_token_ids:
        raise BenchInputError(
            f"the {workload.name} workload extends each prompt with the reply's token ids; the {backend.kind} backend "
            "only gets text back: give --tokenizer DIR (the served model's) to re-tokenize replies"
        )
    vocab_size = (
        spec.vocab_size or info.vocab_size or (len(backend.tokenizer) if backend.tokenizer is not None else None)
    )
    if workload.uses_token_ids and not vocab_size:
        raise BenchInputError(
            f"the server at {spec.address} does not say its vocabulary size, which random token ids need: "
            "give --vocab-size N or --tokenizer DIR"
        )
    context = WorkloadContext(
        vocab_size=vocab_size or 0,
        max_context_length=info.max_context_length,
        count_tokens=backend.count_tokens if backend.can_count_tokens else None,
        seed=spec.seed,
        num_runs=len(spec.loads),
    )
    await workload.prepare(context, _expected_sessions(spec))


def _expected_sessions(spec: BenchmarkSpec) -> int:
    if spec.bounds.num_requests is not None:
        return spec.bounds.num_requests
    rates = [load.rate for load in spec.loads]
    if all(math.isfinite(r) for r in rates):
        return math.ceil(max(rates) * spec.bounds.duration_s * 1.2) + 10
    return _SESSIONS_WITHOUT_COUNT


async def _warm_up(backend: Backend, workload: Workload, seed: int, num: int) -> None:
    """First turns of sessions shaped like the workload's, from a run index no measured run
    uses (so their prompts are not the measured ones), replies capped at a few tokens."""
    for i in range(num):
        turn = workload.session(seed, WARMUP_RUN, i).turns[0]
        request = BenchRequest(min(turn.max_tokens, 8), turn.new_token_ids, turn.text)
        response = await backend.send(request)
        if response.error is not None:
            raise BenchInputError(f"the warm-up request failed, so no load was sent: {response.error}")


async def _run_load(spec: BenchmarkSpec, backend: Backend, load: LoadSpec, run: int) -> RunOutcome:
    progress = None
    if spec.progress:
        from tqdm import tqdm

        progress = tqdm(
            total=spec.bounds.num_requests, desc=load.label(), unit="req", file=sys.stderr, dynamic_ncols=True
        )
    try:
        return await LoadRunner(backend, spec.workload, load, spec.bounds, spec.seed, run, progress).run()
    finally:
        if progress is not None:
            progress.close()
