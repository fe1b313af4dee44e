#!/usr/bin/env python3
"""The engine's decode step on a GPU, eager against CUDA graphs (engine.runner.cuda_graphs).

    python3 bench/gpu_decode_graphs.py          (also part of `make gpu-check`)

The bench model (`baton make-tiny-model --preset bench`: a random 33.6M-parameter Llama) in
bfloat16, no prefix caching, 128-token random prompts. A decode step's time is the time of a
65-token generate less a 1-token one, over 64 steps, best of alternating rounds; the two
engines (graphs off, on) are alive together and take turns. A model this small is all launch
cost on a GPU, which is what graphs remove: larger models gain less.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

BATCHES = (1, 8, 32)
PROMPT_LEN = 128
DECODE_STEPS = 64
ROUNDS = 3


def decode_step_ms(llm, batch: int, rng: random.Random) -> float:
    from baton.services.engine import SamplingParams

    vocab = llm.core.arch.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(PROMPT_LEN)]} for _ in range(batch)]
    elapsed = []
    for max_tokens in (1, DECODE_STEPS + 1):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        elapsed.append(time.perf_counter() - start)
    return (elapsed[1] - elapsed[0]) / DECODE_STEPS * 1e3


def decode_graphs_case() -> str:
    """Prints each batch's times; returns the summary line."""
    from baton.services.engine import LLM
    from baton.services.model.tiny import make_tiny_model

    print(f"\n== engine decode step, eager vs CUDA graphs: bench model, bf16, batches {BATCHES} ==")
    model_dir = Path(tempfile.mkdtemp(prefix="baton-bench-model-"))
    make_tiny_model(model_dir, arch="llama", preset="bench")
    settings = dict(dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=max(BATCHES), num_kv_blocks=4096)
    engines = {arm: LLM(model=str(model_dir), cuda_graphs=arm == "graphs", **settings) for arm in ("eager", "graphs")}
    rng = random.Random(0)
    best = {(arm, b): float("inf") for arm in engines for b in BATCHES}
    for _ in range(ROUNDS):
        for batch in BATCHES:
            for arm, llm in engines.items():
                best[arm, batch] = min(best[arm, batch], decode_step_ms(llm, batch, rng))
    parts = []
    for batch in BATCHES:
        eager, graphs = best["eager", batch], best["graphs", batch]
        print(f"batch {batch}: eager {eager:.3f} ms, graphs {graphs:.3f} ms per step: {eager / graphs:.2f}x")
        parts.append(f"batch {batch} {eager:.2f} -> {graphs:.2f} ms ({eager / graphs:.2f}x)")
    replays = engines["graphs"].core.executor.rank.runner.graphs.num_replays
    for llm in engines.values():
        llm.shutdown()
    return f"engine decode step with CUDA graphs (bench model, bf16): {', '.join(parts)}; {replays} replays"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_check
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU; none is visible")
        sys.exit(2)
    gpu_check.ensure_baton_importable()
    print(decode_graphs_case())
