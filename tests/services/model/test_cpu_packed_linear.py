"""Packed linear weights on the CPU (services/model/linear.py): oneDNN's layout, Baton's float32
blocks where the kernel builds (test_blocked_linear.py tests the kernel itself), what gets
packed which way, and that the packed model computes what the dense one does."""

from __future__ import annotations

import pytest
import torch
from baton.services.engine import LLM, SamplingParams
from baton.services.model.blocked_linear import uses_blocked_kernel
from baton.services.model.linear import dense_parameters, dense_weight, linear, pack_weight_for_cpu

PROMPTS = ["def foo(x):", "The quick brown fox jumps over the lazy dog because", "Hello"]


def runner(model_dir, kernel_backend: str):
    llm = LLM(model=str(model_dir), kernel_backend=kernel_backend, num_kv_blocks=64, dtype="float32")
    return llm, llm.core.executor.rank.runner


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_equals_f_linear(rows):
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 40, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 40, generator=gen)
    packed = pack_weight_for_cpu(weight)
    assert packed is not None and packed.layout == torch._mkldnn
    torch.testing.assert_close(linear(x, packed, bias), torch.nn.functional.linear(x, weight, bias))
    torch.testing.assert_close(linear(x[:, ::2].repeat(1, 2), packed), x[:, ::2].repeat(1, 2) @ weight.T)  # strided x
    assert torch.equal(dense_weight(packed), weight)


@pytest.mark.parametrize(
    ("dtype", "supported"),
    [
        (torch.bfloat16, torch.ops.mkldnn._is_mkldnn_bf16_supported),
        (torch.float16, torch.ops.mkldnn._is_mkldnn_fp16_supported),
    ],
)
def test_half_precision_weights_are_packed_where_the_cpu_multiplies_them(dtype, supported):
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 40, generator=gen).to(dtype), torch.randn(96, generator=gen).to(dtype)
    packed = pack_weight_for_cpu(weight)
    if not supported():
        assert packed is None
        return
    assert packed.layout == torch._mkldnn and torch.equal(dense_weight(packed), weight)
    for rows in (1, 7, 300):
        x = torch.randn(rows, 40, generator=gen).to(dtype)
        torch.testing.assert_close(linear(x, packed, bias), torch.nn.functional.linear(x, weight, bias))


def test_integer_weights_are_not_packed():
    assert pack_weight_for_cpu(torch.ones(8, 8, dtype=torch.int8)) is None


def test_the_engine_packs_every_linear_and_keeps_the_tied_embedding_dense(qwen3_dir):
    _, packed_runner = runner(qwen3_dir, "auto")
    model = packed_runner.model
    layer = model.model.layers[0]
    blocks = uses_blocked_kernel(torch.ones(1), "auto")  # float32: blocks where the kernel builds
    for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        if blocks:
            assert module.blocked is not None and module.weight is not None and module.weight.dim() == 3
            assert module.weight.data_ptr() == module.blocked.values.data_ptr()  # one copy
        else:
            assert module.blocked is None and module.weight.layout == torch._mkldnn
    assert (model.lm_head.blocked if blocks else model.lm_head.packed_weight) is not None
    assert model.lm_head.weight is model.model.embed_tokens.weight  # qwen3 ties them
    assert model.model.embed_tokens.weight.layout == torch.strided


def test_the_torch_backend_keeps_dense_weights_and_both_give_the_same_logits(llama_dir):
    _, dense_runner = runner(llama_dir, "torch")
    _, packed_runner = runner(llama_dir, "auto")
    assert dense_runner.model.model.layers[0].mlp.down_proj.weight.layout == torch.strided
    assert dense_runner.model.lm_head.packed_weight is None and dense_runner.model.lm_head.blocked is None
    hidden = torch.randn(5, dense_runner.arch.hidden_size)
    torch.testing.assert_close(
        packed_runner.model.compute_logits(hidden), dense_runner.model.compute_logits(hidden), atol=1e-4, rtol=1e-4
    )
    down = packed_runner.model.model.layers[0].mlp.down_proj
    x = torch.randn(3, down.input_size_per_rank)
    torch.testing.assert_close(down(x), dense_runner.model.model.layers[0].mlp.down_proj(x), atol=1e-4, rtol=1e-4)


def test_bfloat16_packed_and_dense_give_the_same_logits(llama_dir):
    """bfloat16 layers (blocks where the CPU has AVX512-BF16 without AMX or AVX2 without
    AVX-512, oneDNN's layout elsewhere) against plain F.linear: float32 sums of the same
    bfloat16 products."""
    dense = LLM(model=str(llama_dir), kernel_backend="torch", num_kv_blocks=64, dtype="bfloat16")
    packed = LLM(model=str(llama_dir), kernel_backend="auto", num_kv_blocks=64, dtype="bfloat16")
    dense_model = dense.core.executor.rank.runner.model
    packed_model = packed.core.executor.rank.runner.model
    down = packed_model.model.layers[0].mlp.down_proj
    assert (down.blocked is not None) == uses_blocked_kernel(torch.ones(1, dtype=torch.bfloat16), "auto")
    x = torch.randn(5, down.input_size_per_rank).bfloat16()
    torch.testing.assert_close(down(x), dense_model.model.layers[0].mlp.down_proj(x), atol=2e-2, rtol=1.6e-2)
    hidden = torch.randn(3, dense_model.arch.hidden_size).bfloat16()
    torch.testing.assert_close(
        packed_model.compute_logits(hidden), dense_model.compute_logits(hidden), atol=5e-2, rtol=1.6e-2
    )


def test_worker_parameters_read_back_dense(llama_dir):
    llm, packed_runner = runner(llama_dir, "auto")
    params = llm.core.executor.rank.named_parameters()
    weight = params["model.layers.0.mlp.down_proj.weight"]
    assert weight.layout == torch.strided
    assert torch.equal(weight, dense_parameters(packed_runner.model)["model.layers.0.mlp.down_proj.weight"])
    dense_llm, _ = runner(llama_dir, "torch")  # nothing packed: the checkpoint's own values
    for name, value in dense_llm.core.executor.rank.named_parameters().items():
        assert torch.equal(params[name], value), name


def test_packed_and_dense_engines_generate_the_same(llama_dir):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = [runner(llama_dir, backend)[0].generate(PROMPTS, params) for backend in ("torch", "auto")]
    assert [o.token_ids for o in outputs[0]] == [o.token_ids for o in outputs[1]]
