"""quantization="int8" through `LLM`: what gets quantized, agreement with float32, the
compressed-tensors W8A16 layout (a checkpoint this test writes from a float model), configs
that are refused by name, and weight updates that re-quantize what they write."""

from __future__ import annotations

import json

import pytest
import torch
from baton.services.engine import LLM, ModelLoadError, SamplingParams
from baton.services.engine.config import ModelConfig
from baton.services.model.compressed_tensors import read_quantization_config
from baton.services.model.int8_linear import quantize_int8
from baton.services.model.linear import packable_modules
from pydantic import ValidationError
from safetensors.torch import load_file
from testlib.agreement import teacher_forced
from testlib.int8_checkpoint import write_w8a16
from testlib.models import tiny_model

NUM_BLOCKS = 128


def engine(model_dir, **kwargs) -> LLM:
    return LLM(model=str(model_dir), num_kv_blocks=NUM_BLOCKS, dtype="float32", **kwargs)


def int8_state(llm) -> dict[str, tuple[torch.Tensor, torch.Tensor] | None]:
    """Each packable layer's int8 values and scales (None: a float layer)."""
    model = llm.core.executor.rank.runner.model
    names = {module: name for name, module in model.named_modules()}
    return {names[m]: None if m.int8 is None else (m.int8.int8_values, m.int8.scale) for m in packable_modules(model)}


def assert_same_int8(a: dict, b: dict, skip: tuple[str, ...] = ()) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if name not in skip:
            assert a[name] is not None and b[name] is not None, name
            assert torch.equal(a[name][0], b[name][0]) and torch.equal(a[name][1], b[name][1]), name


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_linear_and_the_head_are_int8_and_the_tied_embedding_stays_float(arch):
    llm = engine(tiny_model(arch), quantization="int8")
    model = llm.core.executor.rank.runner.model
    layer = model.model.layers[0]
    for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert module.int8 is not None and module.weight.dtype == torch.int8
    assert model.lm_head.int8 is not None
    assert model.model.embed_tokens.weight.dtype == torch.float32
    if arch == "qwen3":  # ties them: the embedding is the float weight the head's int8 copy came from
        assert model.lm_head.weight is model.model.embed_tokens.weight
    _, int8_bytes = llm.core.executor.rank.memory_bytes()
    _, float_bytes = engine(tiny_model(arch)).core.executor.rank.memory_bytes()
    assert int8_bytes < float_bytes  # the float weights are gone, not kept beside the int8


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kernel_backend", ["auto", "torch"])
def test_int8_agrees_with_float32(arch, kernel_backend):
    """Measured on these random tiny models (6 prompts x 24 tokens, teacher-forced; "auto"
    scores the prompts on the AMX path, bfloat16 activations): argmax agreement 0.94-0.99,
    mean |logprob error| 0.012-0.013, max 0.045-0.050. The bounds leave 2-4x; a wrong scale
    or channel order puts the error at whole nats."""
    model_dir = tiny_model(arch)
    reference = engine(model_dir)
    agreement, errors, outputs = teacher_forced(
        reference, engine(model_dir, quantization="int8", kernel_backend=kernel_backend)
    )
    print(
        f"{arch}/{kernel_backend}: agreement {agreement:.3f}, mean |dlogprob| {sum(errors) / len(errors):.4f}, max {max(errors):.4f}"
    )
    assert agreement >= 0.9
    assert sum(errors) / len(errors) < 0.03 and max(errors) < 0.2
    assert min(errors) >= 0 and max(errors) > 0  # int8 is not float32 (else this measured nothing)


def test_a_compressed_tensors_checkpoint_loads_the_int8_that_quantizing_at_load_gives(tmp_path):
    float_dir = tiny_model("llama")
    write_w8a16(float_dir, tmp_path / "w8a16")
    at_load = engine(float_dir, quantization="int8")
    stored = engine(tmp_path / "w8a16")  # quantization None: as the checkpoint stores it
    assert_same_int8(int8_state(stored), int8_state(at_load), skip=("lm_head",))
    assert int8_state(stored)["lm_head"] is None  # "ignore": ["lm_head"] keeps it float
    stored_all = engine(tmp_path / "w8a16", quantization="int8")  # and int8 quantizes the rest at load
    assert_same_int8(int8_state(stored_all), int8_state(at_load))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    a, b = at_load.generate(["def foo(x):", "Hello"], params), stored_all.generate(["def foo(x):", "Hello"], params)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].cumulative_logprob == pytest.approx(y.outputs[0].cumulative_logprob, abs=1e-4)


def test_the_checkpoint_integers_load_exactly_even_minus_128(tmp_path):
    float_dir = tiny_model("llama")
    values = write_w8a16(float_dir, tmp_path / "w8a16", scheme="minmax-127.5", ignore=())
    assert any((q == -128).any() for q in values.values())
    state = int8_state(engine(tmp_path / "w8a16"))
    qkv = state["model.layers.1.self_attn.qkv_proj"][0]
    expected = torch.cat([values[f"model.layers.1.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(qkv, expected)
    assert torch.equal(state["model.layers.0.mlp.down_proj"][0], values["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(state["lm_head"][0], values["lm_head.weight"])


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        (("quant_method",), "gptq", "quant_method"),
        (("format",), "float-quantized", "format"),
        (("config_groups", "group_0", "format"), "int-quantized", "differs"),
        (("config_groups", "group_0", "weights", "num_bits"), 4, "num_bits"),
        (("config_groups", "group_0", "weights", "strategy"), "group", "strategy"),
        (("config_groups", "group_0", "weights", "group_size"), 128, "group_size"),
        (("config_groups", "group_0", "weights", "symmetric"), False, "symmetric"),
        (("config_groups", "group_0", "input_activations"), {"num_bits": 8, "dynamic": False}, "dynamic"),
        (("config_groups", "group_0", "input_activations"), {"strategy": "tensor"}, "strategy"),
        (("config_groups", "group_0", "output_activations"), {"num_bits": 8}, "output"),
        (("kv_cache_scheme",), {"num_bits": 8}, "kv_cache_scheme"),
    ],
)
def test_unsupported_quantization_configs_are_refused_by_name(tmp_path, path, value, named):
    write_w8a16(tiny_model("llama"), tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert read_quantization_config(tmp_path / "q") is not None
    node = config["quantization_config"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=named):
        read_quantization_config(tmp_path / "q")
    if path == ("config_groups", "group_0", "weights", "num_bits"):  # and through the engine
        with pytest.raises(ModelLoadError, match="num_bits is 4"):
            engine(tmp_path / "q")


def test_groups_that_mix_weight_only_and_w8a8_are_refused(tmp_path):
    write_w8a16(tiny_model("llama"), tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    groups["group_1"] = groups["group_0"] | {"input_activations": {"strategy": "token", "dynamic": True}}
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="weight-only and W8A8 groups"):
        read_quantization_config(tmp_path / "q")


def test_the_engine_config_refuses_other_quantizations():
    assert ModelConfig(model="m", quantization="int8").quantization == "int8"
    with pytest.raises(ValidationError, match="int8"):
        ModelConfig(model="m", quantization="int4")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_an_update_is_re_quantized(arch):
    old_dir, new_dir = tiny_model(arch), tiny_model(arch, seed=1)
    llm = engine(old_dir, quantization="int8")
    before = int8_state(llm)
    new = load_file(new_dir / "model.safetensors")
    # A partial update: q_proj alone changes its share of the merged qkv; k and v keep theirs.
    q_name = "model.layers.0.self_attn.q_proj.weight"
    llm.update_weights_from_tensors([(q_name, new[q_name])])
    qkv, old_qkv = int8_state(llm)["model.layers.0.self_attn.qkv_proj"], before["model.layers.0.self_attn.qkv_proj"]
    num_q = new[q_name].shape[0]
    assert torch.equal(qkv[0][:num_q], quantize_int8(new[q_name])[0])
    assert torch.equal(qkv[0][num_q:], old_qkv[0][num_q:]) and torch.equal(qkv[1][num_q:], old_qkv[1][num_q:])
    # A whole folder: every layer as a fresh int8 engine on the new weights has it.
    llm.update_weights_from_disk(str(new_dir))
    fresh = engine(new_dir, quantization="int8")
    assert_same_int8(int8_state(llm), int8_state(fresh))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["def foo(x):", "The quick brown fox"]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in fresh.generate(prompts, params)
    ]


def test_after_sleep_level_2_a_complete_update_is_quantized_again():
    old_dir, new_dir = tiny_model("llama"), tiny_model("llama", seed=1)
    llm = engine(old_dir, quantization="int8")
    _, int8_bytes = llm.core.weights.memory_bytes()
    llm.sleep(2)  # the int8 weights are freed, the layers float and empty
    assert llm.core.weights.memory_bytes()[1] == 0
    llm.wake_up()
    llm.update_weights_from_disk(str(new_dir))
    assert_same_int8(int8_state(llm), int8_state(engine(new_dir, quantization="int8")))
    assert llm.core.weights.memory_bytes()[1] == int8_bytes  # int8 again, not the float it was written as


def test_a_prefix_cache_hit_generates_what_a_miss_does():
    llm = engine(tiny_model("llama"), quantization="int8", block_size=16)
    prompt = list(range(20, 60))  # two full blocks and a partial one
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    miss, hit = llm.generate([prompt], params)[0], llm.generate([prompt], params)[0]
    assert miss.num_cached_tokens == 0 and hit.num_cached_tokens == 32
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
    assert hit.outputs[0].cumulative_logprob == pytest.approx(miss.outputs[0].cumulative_logprob, abs=1e-3)
