"""Updates from disk and from tensors through `LLM`: outputs equal Hugging Face on the new
weights, versions count, a refused update changes nothing, and the prefix cache never
serves K/V of old weights."""

from __future__ import annotations

import shutil

import pytest
from baton.services.engine import LLM, ModelLoadError, SamplingParams
from baton.services.engine.core.kv_events import AllBlocksCleared, InMemoryKVEventPublisher
from safetensors.torch import load_file, save_file
from testlib.models import tiny_model
from testlib.weight_updates import MAX_TOKENS, PROMPTS, assert_equals_hf

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
NUM_BLOCKS = 64


@pytest.fixture
def llm(old_dir):
    llm = LLM(model=str(old_dir), num_kv_blocks=NUM_BLOCKS, block_size=16)
    yield llm
    llm.shutdown()


def prompt_ids(llm) -> list[list[int]]:
    return [llm.tokenizer.encode(p) for p in PROMPTS]


def assert_no_leak(llm) -> None:
    llm.core.check_integrity()
    assert llm.core.scheduler.kv.num_free_blocks == llm.core.num_kv_blocks


def test_update_from_disk_equals_hf_on_the_new_weights(llm, old_dir, new_dir):
    ids = prompt_ids(llm)
    before = llm.generate(ids, GREEDY)
    assert_equals_hf(old_dir, ids, before)
    assert {o.weight_version for o in before} == {"0"}
    assert llm.update_weights_from_disk(str(new_dir)) == "1"
    after = llm.generate(ids, GREEDY)
    assert_equals_hf(new_dir, ids, after)
    assert {o.weight_version for o in after} == {"1"}
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    assert_no_leak(llm)


def test_update_from_tensors_takes_the_callers_version(llm, new_dir):
    ids = prompt_ids(llm)
    named = list(load_file(new_dir / "model.safetensors").items())
    assert llm.update_weights_from_tensors(named, weight_version="step-7") == "step-7"
    after = llm.generate(ids, GREEDY)
    assert_equals_hf(new_dir, ids, after)
    assert {o.weight_version for o in after} == {"step-7"} and llm.weight_version == "step-7"
    assert llm.update_weights_from_tensors(named) == "2"  # the counter goes on


def test_a_partial_update_keeps_the_other_shards_of_merged_weights(llm, old_dir, new_dir, tmp_path):
    """q_proj and up_proj load into merged, oneDNN-packed parameters (qkv, gate_up): the
    rest of those parameters must survive; the embedding updates a tied head too."""
    old = load_file(old_dir / "model.safetensors")
    new = load_file(new_dir / "model.safetensors")
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight"]
    mixed_dir = tmp_path / "mixed"
    shutil.copytree(old_dir, mixed_dir)
    save_file({**old, **{n: new[n] for n in names}}, mixed_dir / "model.safetensors", metadata={"format": "pt"})
    llm.update_weights_from_tensors([(n, new[n]) for n in names])
    ids = prompt_ids(llm)
    assert_equals_hf(mixed_dir, ids, llm.generate(ids, GREEDY))


def test_a_refused_update_changes_nothing(llm, old_dir, new_dir):
    ids = prompt_ids(llm)
    before = llm.generate(ids, GREEDY)
    new = load_file(new_dir / "model.safetensors")
    bad = "model.layers.1.mlp.down_proj.weight"
    named = list(new.items())  # every good tensor first: checked before any is written
    named.remove((bad, new[bad]))
    named.append((bad, new[bad][:, :-1]))
    with pytest.raises(ModelLoadError, match=r"down_proj\.weight.*shape"):
        llm.update_weights_from_tensors(named)
    with pytest.raises(ModelLoadError, match="no_such_layer"):
        llm.update_weights_from_tensors([*new.items(), ("model.no_such_layer.weight", new[bad])])
    other = tiny_model("qwen3" if "llama" in old_dir.name else "llama")
    with pytest.raises(ModelLoadError, match="architecture"):
        llm.update_weights_from_disk(str(other))
    wider = tiny_model(old_dir.name.split("-")[0], intermediate_size=192)
    with pytest.raises(ModelLoadError, match="intermediate_size"):
        llm.update_weights_from_disk(str(wider))
    after = llm.generate(ids, GREEDY)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert llm.weight_version == "0" and {o.weight_version for o in after} == {"0"}
    assert_no_leak(llm)


def test_a_folder_missing_a_tensor_is_refused_by_name(llm, old_dir, new_dir, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(new_dir, partial)
    tensors = load_file(new_dir / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lacks tensors model\.layers\.0\.self_attn\.k_proj\.weight"):
        llm.update_weights_from_disk(str(partial))
    ids = prompt_ids(llm)
    assert_equals_hf(old_dir, ids, llm.generate(ids, GREEDY))


def test_the_prefix_cache_is_not_reused_across_versions(llm, new_dir):
    publisher = llm.core.publisher = InMemoryKVEventPublisher()
    ids = [llm.tokenizer.encode(PROMPTS[2])]  # several full blocks
    assert len(ids[0]) > 32
    llm.generate(ids, GREEDY)
    (warm,) = llm.generate(ids, GREEDY)
    assert warm.num_cached_tokens >= 32  # same version: the prefix is reused
    llm.update_weights_from_disk(str(new_dir))
    assert any(isinstance(e, AllBlocksCleared) for e in publisher.events)  # the router drops this worker's index
    (fresh,) = llm.generate(ids, GREEDY)
    assert fresh.num_cached_tokens == 0
    assert_equals_hf(new_dir, ids, [fresh])
    assert_no_leak(llm)


def test_reset_prefix_cache_with_requests_running_keeps_the_cache_sound(llm):
    core = llm.core
    core.add_request("r", PROMPTS[2], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    core.step()
    assert llm.reset_prefix_cache()
    assert not core.scheduler.kv.pool.cached  # nothing cached, and nothing registered later
    while core.has_unfinished_requests():
        core.step()
    assert not core.scheduler.kv.pool.cached
    assert_no_leak(llm)
