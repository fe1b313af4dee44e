"""Beam search equals Hugging Face's (EOS never finishing a beam, length_penalty 0)."""

from __future__ import annotations

import pytest
import torch
from baton.services.engine import LLM, SamplingParams
from testlib.hf import hf_model


def hf_beams(path, prompt_ids, width, max_new_tokens):
    model = hf_model(path)
    input_ids = torch.tensor([prompt_ids])
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # EOS is an ordinary token, like ignore_eos
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                num_beams=width,
                num_return_sequences=width,
                do_sample=False,
                length_penalty=0.0,
                max_new_tokens=max_new_tokens,
                output_scores=True,
                return_dict_in_generate=True,
            )
    finally:
        model.generation_config.eos_token_id = eos
    return [seq[len(prompt_ids) :].tolist() for seq in out.sequences], out.sequences_scores.tolist()


@pytest.mark.parametrize("width", [2, 4])
def test_beams_equal_hf(model_dir, width):
    llm = LLM(model=str(model_dir), num_kv_blocks=256, block_size=16)
    prompts = ["The quick brown fox", "def main():\n    return", "A" * 40]
    params = SamplingParams(use_beam_search=True, beam_width=width, max_tokens=12, ignore_eos=True, length_penalty=0.0)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_scores = hf_beams(model_dir, llm.tokenizer.encode(prompt), width, 12)
        assert [c.token_ids for c in out.outputs] == ref_tokens
        assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(ref_scores, abs=1e-3)
        assert all(c.finish_reason == "length" for c in out.outputs)
    llm.core.check_integrity()
    assert llm.core.scheduler.kv.num_free_blocks == 256


def test_beams_share_blocks_by_reference(llama_dir):
    from baton.services.engine.config import EngineConfig
    from baton.services.engine.engine_core import EngineCore

    engine = EngineCore(EngineConfig.from_kwargs(model=str(llama_dir), num_kv_blocks=64, block_size=16))
    engine.add_request("b", list(range(100, 150)), SamplingParams(use_beam_search=True, beam_width=3, max_tokens=8))
    for _ in range(3):
        engine.step()
    tables = [engine.scheduler.kv.get_block_ids(rid) for rid in engine.groups.engine_ids("b")]
    assert len(tables) == 3
    shared = set(tables[0][:3])
    assert all(set(t[:3]) == shared for t in tables), "the prompt's full blocks are shared"
    assert all(engine.scheduler.kv.pool.blocks[b].ref_cnt == 3 for b in shared)
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert engine.scheduler.kv.num_free_blocks == 64
