"""What RL training reads from a rollout: the logprob of every SAMPLED token (temperature 1,
seeded), after an update, equals Hugging Face transformers' float32 logprob of that token
on the new weights, within 1e-3 (teacher-forced over prompt + sampled tokens)."""

from __future__ import annotations

import pytest
import torch
from baton.services.engine import LLM, SamplingParams
from safetensors.torch import load_file
from testlib.hf import hf_model
from testlib.weight_updates import PROMPTS

MAX_TOKENS = 16


def hf_logprobs_of(model_dir, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
    """HF's log-softmax at each sampled position, of the token the engine sampled there."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = hf_model(model_dir)(ids).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    return logprobs[torch.arange(len(token_ids)), torch.tensor(token_ids)].tolist()


@pytest.mark.parametrize("kind", ["disk", "tensors"])
def test_sampled_tokens_logprobs_equal_hf_on_the_new_weights(old_dir, new_dir, kind):
    llm = LLM(model=str(old_dir), num_kv_blocks=64)
    try:
        if kind == "disk":
            llm.update_weights_from_disk(str(new_dir))
        else:
            llm.update_weights_from_tensors(list(load_file(new_dir / "model.safetensors").items()))
        ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        sampled = llm.generate(
            ids, [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, logprobs=1) for i in range(len(ids))]
        )
        greedy = llm.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        assert [o.token_ids for o in sampled] != [o.token_ids for o in greedy]  # sampled, not argmax
        for prompt, out in zip(ids, sampled, strict=True):
            assert out.weight_version == "1" and len(out.logprobs) == len(out.token_ids)
            reference = hf_logprobs_of(new_dir, prompt, out.token_ids)
            got = [entry[token].logprob for token, entry in zip(out.token_ids, out.logprobs, strict=True)]
            assert got == pytest.approx(reference, abs=1e-3)
    finally:
        llm.shutdown()
