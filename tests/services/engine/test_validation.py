"""Bad input gets a clear error naming the problem, before any work is scheduled."""

from __future__ import annotations

import json
import shutil

import pytest
from baton.services.engine import LLM, InvalidRequestError, ModelLoadError, SamplingParams


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_p": 2.0}, "min_p"),
        ({"n": 0}, "n"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"use_beam_search": True, "beam_width": 2, "n": 2}, "n"),
        # Non-finite floats (Python's json reads Infinity and NaN): inf passes most range checks.
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"presence_penalty": float("-inf")}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"length_penalty": float("nan")}, "length_penalty"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert field in str(info.value)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=str(llama_dir), num_kv_blocks=64, max_model_len=64)


def test_prompt_over_the_context_limit(llm):
    prompt = list(range(10, 80))
    with pytest.raises(InvalidRequestError, match="70 tokens.*limit is 64"):
        llm.generate([prompt], SamplingParams())
    assert not llm.core.has_unfinished_requests()


def test_prompt_plus_max_tokens_over_the_context_is_refused_with_the_numbers(llm):
    prompt = list(range(10, 70))  # 60 tokens; 4 fit after it in 64
    with pytest.raises(InvalidRequestError, match="60 tokens.*max_tokens is 5.*64") as info:
        llm.generate([prompt], SamplingParams(max_tokens=5))
    assert info.value.field == "max_tokens"
    assert not llm.core.has_unfinished_requests()
    (fits,) = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(fits.outputs[0].token_ids) == 4


def test_max_tokens_none_means_the_rest_of_the_context(llm):
    prompt = list(range(10, 70))
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_lone_surrogate_in_a_text_prompt_is_refused(llm):
    with pytest.raises(InvalidRequestError, match="surrogate") as info:
        llm.generate(["ok \ud800"], SamplingParams())
    assert info.value.field == "prompt" and "TextEncodeInput" not in str(info.value)


def test_engine_checks_need_the_model(llm):
    with pytest.raises(InvalidRequestError, match="logprobs"):
        llm.generate(["hi"], SamplingParams(logprobs=21))
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        llm.generate(["hi"], SamplingParams(stop_token_ids=[10**6]))
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        llm.generate([[1, 2, 10**6]], SamplingParams())
    with pytest.raises(InvalidRequestError, match="prompt"):
        llm.generate([""], SamplingParams())


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 2**31}, "n"),
        ({"n": 1, "best_of": 2**40}, "best_of"),
        ({"use_beam_search": True, "beam_width": 10**6}, "beam_width"),
    ],
)
def test_samples_per_request_are_bounded_by_max_num_seqs(llm, kwargs, field):
    """Each sample is a sequence: billions of them would stall the engine while it built them."""
    max_num_seqs = llm.core.config.scheduler.max_num_seqs
    with pytest.raises(InvalidRequestError, match=f"{field}.*<= {max_num_seqs}"):
        llm.generate(["hi"], SamplingParams(max_tokens=1, **kwargs))
    assert not llm.core.has_unfinished_requests()
    outputs = llm.generate(["hi"], SamplingParams(max_tokens=1, n=max_num_seqs))
    assert len(outputs[0].outputs) == max_num_seqs


def test_one_bad_prompt_queues_nothing(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", list(range(100))], SamplingParams())
    assert not llm.core.has_unfinished_requests()
    assert llm.core.scheduler.kv.num_free_blocks == 64


def test_unknown_engine_argument(llama_dir):
    with pytest.raises(TypeError, match="block_sise"):
        LLM(model=str(llama_dir), block_sise=16)
    with pytest.raises(ValueError, match="block_size"):
        LLM(model=str(llama_dir), block_size=12)


def test_kv_cache_smaller_than_context(llama_dir):
    with pytest.raises(ValueError, match="max_model_len 512"):
        LLM(model=str(llama_dir), num_kv_blocks=4, max_model_len=512)


@pytest.fixture
def broken_copy(llama_dir, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(llama_dir, target)
    return target


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"))


def test_missing_config(broken_copy):
    (broken_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        LLM(model=str(broken_copy))


def test_unsupported_architecture(broken_copy):
    config = json.loads((broken_copy / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (broken_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(model=str(broken_copy))


def test_corrupt_weights_name_the_file(broken_copy):
    (broken_copy / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(model=str(broken_copy))


def test_missing_weights(broken_copy):
    (broken_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(model=str(broken_copy))


def test_missing_tokenizer(broken_copy):
    (broken_copy / "tokenizer.json").unlink()
    (broken_copy / "tokenizer_config.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer"):
        LLM(model=str(broken_copy))


def test_truncated_checkpoint_names_missing_tensor(broken_copy):
    from safetensors.torch import load_file, save_file

    tensors = load_file(broken_copy / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lacks tensors model\.layers\.1\.mlp\.up_proj\.weight"):
        LLM(model=str(broken_copy))
