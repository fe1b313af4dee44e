"""Every supported architecture equals Hugging Face (float32), and lower precisions run."""

from __future__ import annotations

import pytest
from baton.services.engine import LLM, SamplingParams
from baton.services.model.config import load_model_arch
from testlib.hf import hf_greedy
from testlib.models import tiny_model

PROMPTS = ["def foo(x):", "The quick brown fox jumps over the lazy dog because", "Hello"]


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_greedy_equals_hf(arch):
    path = tiny_model(arch)
    llm = LLM(model=str(path), num_kv_blocks=128)
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        (out,) = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0))
        assert out.token_ids == hf_greedy(path, ids, 16)[0]


def test_architecture_specifics_are_read():
    qwen2, qwen3, mistral = (load_model_arch(tiny_model(a)) for a in ("qwen2", "qwen3", "mistral"))
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.tie_word_embeddings
    assert mistral.architecture == "MistralForCausalLM" and not mistral.qkv_bias


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_lower_precision_runs(llama_dir, dtype):
    llm = LLM(model=str(llama_dir), num_kv_blocks=64, dtype=dtype)
    assert llm.core.executor.rank.runner.dtype.itemsize == 2
    (out,) = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 8
