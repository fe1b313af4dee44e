"""Structured-output benchmarks (CPU, float32, the bench model), each against a baseline
measured in the same run.

tpot     decode time per output token under a JSON schema vs unconstrained, at batch 1 and
         32: the same prompts and exactly the same number of output tokens. The schema asks
         for an array of at least 1,000 records, so no output can finish before max_tokens
         and every constrained request ends "length" with max_tokens tokens, as the
         unconstrained ones do with ignore_eos; the batch stays full to the end. TPOT of a
         request = (finish - first token) / (tokens - 1); a run's TPOT is the mean over its
         requests. The two modes alternate, run after run; on a shared machine other work
         only ever adds time, so the headline is each mode's fastest run (with the median of
         the paired ratios beside it). Goal: overhead <= 10%.
compile  grammar compile time through the engine's compiler (the bench model's 8,192-token
         vocabulary), over JSONSchemaBench's schemas (../shared/jsonschemabench) and a few
         chosen ones: cold on a fresh compiler per schema, cold on one compiler that has
         compiled the schemas before it (as on a running engine), and cached (the same spec
         again, served from the engine's grammar cache).
ttft     time from request to first token through AsyncLLM, one request at a time on an idle
         engine: a schema compiled cold, the same schema again (cached) and no schema, for
         each JSONSchemaBench schema that compiles; median and p90.

  python bench/structured_output.py [tpot|compile|ttft|all] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator

import torch
from baton.services.engine import AsyncLLM, SamplingParams
from baton.services.engine.api.sampling_params import StructuredOutputKind, StructuredOutputParams
from baton.services.engine.config import EngineConfig
from baton.services.engine.engine_core import EngineCore
from baton.services.engine.errors import InvalidRequestError
from baton.services.engine.structured_output.grammar_compiler import GrammarCompiler
from common import REPO, bench_model, num_params, percentile

SCHEMA_DIR = REPO.parent / "shared" / "jsonschemabench"
RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "name", "ok"],
    "additionalProperties": False,
}
RECORDS = {"type": "array", "items": RECORD, "minItems": 1000}  # never complete within max_tokens


def json_constraint(schema: dict | str) -> StructuredOutputParams:
    return StructuredOutputParams(StructuredOutputKind.JSON, schema if isinstance(schema, str) else json.dumps(schema))


def bench_schemas() -> dict[str, str]:
    if not SCHEMA_DIR.is_dir():
        raise SystemExit(f"JSONSchemaBench schemas not found at {SCHEMA_DIR}: the repository must sit next to shared/")
    return {str(p.relative_to(SCHEMA_DIR)): p.read_text() for p in sorted(SCHEMA_DIR.glob("*/*.json"))}


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Hides xgrammar's C++ warnings (one line per unsupported keyword) while compiling."""
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def engine(**overrides) -> EngineCore:
    kwargs = dict(model=str(bench_model()), num_kv_blocks=2048, max_num_seqs=64, enable_prefix_caching=False)
    return EngineCore(EngineConfig.from_kwargs(**{**kwargs, **overrides}))


# -- tpot -------------------------------------------------------------------------------


def mean_tpot(core: EngineCore, prompts: list[list[int]], max_tokens: int, constrained: bool) -> float:
    if constrained:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, structured_output=json_constraint(RECORDS))
    else:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(f"{'c' if constrained else 'u'}{time.monotonic_ns()}-{i}", prompt, params)
    tpots = []
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                done = out.outputs[0]
                assert done.finish_reason == "length" and len(done.token_ids) == max_tokens, done.finish_reason
                tpots.append((out.metrics.finished_time - out.metrics.first_token_time) / (max_tokens - 1))
    return statistics.fmean(tpots)


def bench_tpot(quick: bool) -> None:
    import random

    core = engine()
    core.grammars.submit(json_constraint(RECORDS)).result()  # compile time is not TPOT
    rng = random.Random(0)
    max_tokens, repeats = (16, 3) if quick else (64, 10)
    print(f"model: random Llama, {num_params(bench_model()) / 1e6:.1f}M parameters, {torch.get_num_threads()} threads")
    print(f"{max_tokens} output tokens per request, 64-token prompts, temperature 1, {repeats} runs of each mode")
    for batch in (1, 32):
        prompts = [[rng.randrange(3, 8192) for _ in range(64)] for _ in range(batch)]
        mean_tpot(core, prompts, 8, True)  # warm-up
        mean_tpot(core, prompts, 8, False)
        runs = [
            [mean_tpot(core, prompts, max_tokens, constrained) for constrained in (False, True)] for _ in range(repeats)
        ]
        plain, schema = (min(column) for column in zip(*runs))
        medians = [statistics.median(column) * 1000 for column in zip(*runs)]
        paired = statistics.median(s / p for p, s in runs)
        print(
            f"batch {batch:2}: TPOT unconstrained {plain * 1000:6.2f} ms  with the JSON schema {schema * 1000:6.2f} ms"
            f"  overhead {schema / plain - 1:+.1%} (goal <= +10%); median paired ratio {paired:.3f}"
            f" (medians {medians[0]:.2f} / {medians[1]:.2f} ms)"
        )
    core.shutdown()


# -- compile ----------------------------------------------------------------------------


def timed_compile(compiler: GrammarCompiler, spec: str) -> tuple[float, bool]:
    start = time.perf_counter()
    try:
        compiler.submit(json_constraint(spec)).result()
        ok = True
    except InvalidRequestError:
        ok = False
    return time.perf_counter() - start, ok


def fresh_compiler(core: EngineCore) -> GrammarCompiler:
    """The engine's compiler with nothing compiled yet but its tokenizer info (built by a
    one-rule grammar), so neither the engine's cache nor xgrammar's shared rules help."""
    eos = core.arch.eos_token_ids or (core.tokenizer.eos_token_id,)
    compiler = GrammarCompiler(core.tokenizer, core.arch.vocab_size, eos, core.config.structured_output)
    timed_compile(compiler, '{"type": "boolean"}')
    return compiler


def first_compile_s(core: EngineCore, spec: str) -> float:
    compiler = fresh_compiler(core)
    elapsed, _ = timed_compile(compiler, spec)
    compiler.shutdown()
    return elapsed


def ms(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1000:7.2f} ms  p90 {percentile(values, 90) * 1000:7.2f} ms"


def bench_compile(quick: bool) -> None:
    schemas = bench_schemas()
    if quick:
        schemas = dict(list(schemas.items())[::8])
    core = engine(grammar_cache_size=1024)
    with quiet_stderr():
        startup = time.perf_counter()
        fresh_compiler(core).shutdown()
        startup = time.perf_counter() - startup
        running = {name: timed_compile(core.grammars, spec) for name, spec in schemas.items()}
        compiled = [name for name, (_, ok) in running.items() if ok]
        cached = [timed_compile(core.grammars, schemas[name])[0] for name in compiled]
        first = [first_compile_s(core, schemas[name]) for name in compiled]
    warm = [running[name][0] for name in compiled]
    slowest = max(compiled, key=lambda name: running[name][0])
    print(f"compiler start-up (tokenizer info for the 8,192-token vocabulary): {startup * 1000:.0f} ms")
    print(f"JSONSchemaBench, {len(compiled)}/{len(schemas)} compile:")
    print(f"  cold, fresh compiler                  {ms(first)}  max {max(first) * 1000:7.1f} ms")
    print(f"  cold, one compiler for all            {ms(warm)}  max {max(warm) * 1000:7.1f} ms ({slowest})")
    print(
        f"  cached (the same spec again)          median {statistics.median(cached) * 1e6:7.1f} us"
        f"  max {max(cached) * 1e6:.1f} us; cold / cached {statistics.median(first) / statistics.median(cached):,.0f}x"
    )
    largest = max(compiled, key=lambda name: len(schemas[name]))
    chosen = {
        "one record (4 properties)": json.dumps(RECORD),
        "the tpot schema (array of records)": json.dumps(RECORDS),
        f"the largest that compiles ({largest}, {len(schemas[largest]) // 1024} KiB)": schemas[largest],
    }
    for label, spec in chosen.items():
        with quiet_stderr():
            compiler = fresh_compiler(core)
            cold, _ = timed_compile(compiler, spec)
            hit, _ = timed_compile(compiler, spec)
            compiler.shutdown()
        print(f"  {label}: cold {cold * 1000:.1f} ms, cached {hit * 1e6:.1f} us")
    core.shutdown()


# -- ttft -------------------------------------------------------------------------------


async def first_token_s(llm: AsyncLLM, request_id: str, prompt: list[int], params: SamplingParams) -> float:
    start = time.perf_counter()
    async for out in llm.generate(request_id, prompt, params):
        if out.outputs[0].token_ids:
            return time.perf_counter() - start
    raise AssertionError(f"{request_id} produced no token")


async def ttft_runs(names: list[str], schemas: dict[str, str]) -> dict[str, list[float]]:
    config = EngineConfig.from_kwargs(model=str(bench_model()), num_kv_blocks=2048, enable_prefix_caching=False)
    llm = AsyncLLM(config)
    prompt = list(range(100, 164))
    plain = SamplingParams(max_tokens=1)
    await first_token_s(llm, "warm", prompt, plain)
    await first_token_s(
        llm, "warm-grammar", prompt, SamplingParams(max_tokens=1, structured_output=json_constraint(RECORD))
    )
    times: dict[str, list[float]] = {"cold": [], "cached": [], "none": []}
    for i, name in enumerate(names):
        params = SamplingParams(max_tokens=1, structured_output=json_constraint(schemas[name]))
        times["cold"].append(await first_token_s(llm, f"cold{i}", prompt, params))
        times["cached"].append(await first_token_s(llm, f"cached{i}", prompt, params))
        times["none"].append(await first_token_s(llm, f"none{i}", prompt, plain))
    llm.shutdown()
    return times


def bench_ttft(quick: bool) -> None:
    schemas = bench_schemas()
    probe = engine()
    with quiet_stderr():
        names = [name for name, spec in schemas.items() if timed_compile(probe.grammars, spec)[1]]
    probe.shutdown()
    if quick:
        names = names[::8]
    with quiet_stderr():
        times = asyncio.run(ttft_runs(names, schemas))
    print(f"{len(names)} JSONSchemaBench schemas, one request at a time, 64-token prompt, idle engine")
    base = statistics.median(times["none"])
    for label, key in (("unconstrained   ", "none"), ("cached grammar  ", "cached"), ("cold compile    ", "cold")):
        values = times[key]
        median = statistics.median(values)
        print(
            f"{label} TTFT median {median * 1000:7.1f} ms  p90 {percentile(values, 90) * 1000:7.1f} ms"
            f"  ratio to unconstrained {median / base:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", nargs="?", default="all", choices=["tpot", "compile", "ttft", "all"])
    parser.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    args = parser.parse_args()
    for name, fn in (("tpot", bench_tpot), ("compile", bench_compile), ("ttft", bench_ttft)):
        if args.which in (name, "all"):
            print(f"== {name}")
            fn(args.quick)


if __name__ == "__main__":
    main()
