"""The engine side of bench/peer_vllm_structured.py, for either engine, in a process of its own.

    python bench/peer_vllm_structured_worker.py vllm|baton IN.json OUT.json

vLLM's side runs in vLLM's venv and imports only vLLM and the standard library (and
peer_vllm_worker's version shim); Baton's runs in the project's venv. Both time the same
thing: for each batch size, `generate` of the same prompts with max_tokens M and with
max_tokens 1, constrained by the job's JSON schema or not; TPOT = (t_M - t_1) / (M - 1).
The schema never completes within M tokens, so constrained requests also run to M.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def vllm_runner(job: dict):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=job["model"], dtype="float32", seed=0, enable_prefix_caching=False, **job["limits"])

    def run(prompts: list[list[int]], max_tokens: int, constrained: bool) -> list[int]:
        schema = StructuredOutputsParams(json=job["schema"], disable_any_whitespace=True) if constrained else None
        params = [
            SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True, structured_outputs=schema)
            for i in range(len(prompts))
        ]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    return run


def baton_runner(job: dict):
    from baton.services.engine import LLM, SamplingParams
    from baton.services.engine.api.sampling_params import StructuredOutputKind, StructuredOutputParams

    llm = LLM(model=job["model"], num_kv_blocks=4096, enable_prefix_caching=False, **job["limits"])
    constraint = StructuredOutputParams(StructuredOutputKind.JSON, json.dumps(job["schema"]))

    def run(prompts: list[list[int]], max_tokens: int, constrained: bool) -> list[int]:
        params = [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0,
                seed=i,
                ignore_eos=True,
                structured_output=constraint if constrained else None,
            )
            for i in range(len(prompts))
        ]
        return [len(o.token_ids) for o in llm.generate(prompts, params)]

    return run


def measure(run, job: dict) -> dict:
    max_tokens, results = job["max_tokens"], {}
    run(job["prompts"][:2], 4, True)  # warm-up, the grammar compiled
    for batch in job["batches"]:
        prompts = job["prompts"][:batch]
        for constrained in (False, True):
            best = float("inf")
            for _ in range(job["repeats"]):
                start = time.perf_counter()
                lengths = run(prompts, max_tokens, constrained)
                full = time.perf_counter() - start
                start = time.perf_counter()
                run(prompts, 1, constrained)
                first = time.perf_counter() - start
                assert lengths == [max_tokens] * batch, lengths
                best = min(best, (full - first) / (max_tokens - 1))
            results[f"batch{batch}-{'schema' if constrained else 'free'}"] = best
    return results


if __name__ == "__main__":
    engine, path_in, path_out = sys.argv[1:4]
    job = json.loads(Path(path_in).read_text())
    if engine == "vllm":
        from peer_vllm_worker import patch_version

        patch_version()
        runner = vllm_runner(job)
    else:
        runner = baton_runner(job)
    with open(path_out, "w") as f:
        json.dump({"engine": engine, "tpot_s": measure(runner, job)}, f)
