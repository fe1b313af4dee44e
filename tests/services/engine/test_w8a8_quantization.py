"""quantization "w8a8" in the engine: which layers take int8 activations, agreement with
float32, the kernel's tokens against the reference's, and weight updates keeping the mode."""

from __future__ import annotations

import pytest
import torch
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.config import EngineConfig, ModelConfig, RunnerConfig
from baton.services.model.int8_linear import Int8Weight, quantize_int8
from baton.services.model.w8a8_linear import W8A8Weight
from pydantic import ValidationError
from safetensors.torch import load_file
from testlib.agreement import teacher_forced
from testlib.int8_checkpoint import write_w8a8
from testlib.models import tiny_model


def engine(model_dir, **kwargs) -> LLM:
    return LLM(model=str(model_dir), num_kv_blocks=128, dtype="float32", **kwargs)


def _layers(llm):
    model = llm.core.executor.rank.runner.model
    layer = model.model.layers[0]
    return model, (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)


def test_the_linear_layers_take_int8_activations_and_the_head_stays_weight_only():
    llm = engine(tiny_model("llama"), quantization="w8a8")
    model, layers = _layers(llm)
    for module in layers:
        assert isinstance(module.int8, W8A8Weight) and module.weight.dtype == torch.int8
    assert isinstance(model.lm_head.int8, Int8Weight)  # the logits keep float activations
    assert ModelConfig(model="m", quantization="w8a8").quantization == "w8a8"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_w8a8_agrees_with_float32(arch):
    """Measured on these random tiny models (6 prompts x 24 tokens, teacher-forced): argmax
    agreement 0.94-0.99, mean |logprob error| 0.017-0.018, max 0.064-0.067 (weight-only int8:
    0.94-0.99, 0.012-0.013). The bounds leave 2-3x."""
    model_dir = tiny_model(arch)
    agreement, errors, _ = teacher_forced(engine(model_dir), engine(model_dir, quantization="w8a8"))
    print(f"{arch}: agreement {agreement:.3f}, mean |dlogprob| {sum(errors) / len(errors):.4f}, max {max(errors):.4f}")
    assert agreement >= 0.9
    assert sum(errors) / len(errors) < 0.04 and max(errors) < 0.2
    assert max(errors) > 0


def test_the_kernel_generates_what_the_reference_does():
    """The kernel's sums equal the reference's (tests/services/model/test_w8a8_linear.py), so
    greedy tokens and their logprobs match, prompt and batch alike."""
    model_dir = tiny_model("llama")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [list(range(20, 60)), list(range(100, 107)), [5] * 30]
    kernel = engine(model_dir, quantization="w8a8").generate(prompts, params)
    reference = engine(model_dir, quantization="w8a8", kernel_backend="torch").generate(prompts, params)
    for k, r in zip(kernel, reference, strict=True):
        assert k.outputs[0].token_ids == r.outputs[0].token_ids
        assert k.outputs[0].cumulative_logprob == pytest.approx(r.outputs[0].cumulative_logprob, abs=1e-3)


def test_an_update_keeps_int8_activations():
    old_dir, new_dir = tiny_model("llama"), tiny_model("llama", seed=1)
    llm = engine(old_dir, quantization="w8a8")
    llm.update_weights_from_disk(str(new_dir))
    _, layers = _layers(llm)
    assert all(isinstance(module.int8, W8A8Weight) for module in layers)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["def foo(x):", "The quick brown fox"]
    fresh = engine(new_dir, quantization="w8a8")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in fresh.generate(prompts, params)
    ]


def test_a_compressed_tensors_w8a8_checkpoint_loads_as_w8a8(tmp_path):
    """llm-compressor's W8A8 layout (int-quantized, activations int8 per token): the file's
    integers and scales, int8 activations in the quantized layers, the ignored head float;
    it agrees with float32 as quantizing at load does."""
    float_dir = tiny_model("llama")
    values = write_w8a8(float_dir, tmp_path / "w8a8")
    llm = engine(tmp_path / "w8a8")
    model, layers = _layers(llm)
    assert all(isinstance(module.int8, W8A8Weight) for module in layers)
    assert model.lm_head.int8 is None  # in "ignore": float as stored
    assert torch.equal(layers[3].int8.int8_values, values["model.layers.0.mlp.down_proj.weight"])
    qkv = torch.cat([values[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(layers[0].int8.int8_values, qkv)
    down = load_file(float_dir / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(layers[3].int8.scale, quantize_int8(down)[1])  # the file's scales
    agreement, _, _ = teacher_forced(engine(float_dir), llm)
    assert agreement >= 0.9


def test_int8_runs_a_w8a8_checkpoint_weight_only(tmp_path):
    write_w8a8(tiny_model("llama"), tmp_path / "w8a8")
    _, layers = _layers(engine(tmp_path / "w8a8", quantization="int8"))
    assert all(isinstance(module.int8, Int8Weight) for module in layers)


def test_w8a8_is_refused_off_the_cpu():
    with pytest.raises(ValidationError, match="w8a8 runs on the CPU only"):
        EngineConfig(model=ModelConfig(model="m", quantization="w8a8"), runner=RunnerConfig(device="cuda"))
    with pytest.raises(ValueError, match="this weight is on meta"):
        W8A8Weight.from_float(torch.empty(8, 8, device="meta"), "auto")
