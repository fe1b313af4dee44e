"""Hugging Face transformers as the reference implementation (float32, CPU)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

PROMPTS = [
    "def foo(x):",
    "The quick brown fox jumps over the lazy dog because",
    "import os\nimport sys\n\nclass Config:",
    "Hello",
    "A",
    "for i in range(10): print(i) " * 6,
    "The with statement is used to wrap the execution of a block with methods defined by a context manager.",
    "Unicode: héllo wörld — ☃ ✓",
]


@lru_cache(maxsize=4)
def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def hf_greedy(path: Path, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens (stopping at EOS like the engine) and each chosen token's logprob."""
    model = hf_model(path)
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs
