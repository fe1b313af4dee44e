"""Weight updates with TP=2 (Ray actors, gloo): every kind of update reaches both ranks,
each keeping only its shard; outputs equal Hugging Face on the new weights; a refused
update leaves the rank group running on the old weights; sleep frees every rank's KV."""

from __future__ import annotations

import pytest
import torch
from baton.services.engine import LLM, ModelLoadError, SamplingParams
from safetensors.torch import load_file
from testlib.ray_cluster import local_ray
from testlib.weight_updates import MAX_TOKENS, PROMPTS, assert_equals_hf

pytestmark = pytest.mark.ray

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1)


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray(num_cpus=3) as ray:
        yield ray


def test_every_update_kind_with_tp2(ray_cluster, old_dir, new_dir, tmp_path, trainer_factory):
    llm = LLM(model=str(old_dir), num_kv_blocks=64, tensor_parallel_size=2)
    try:
        ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        new = load_file(new_dir / "model.safetensors")

        llm.update_weights_from_disk(str(new_dir))
        assert_equals_hf(new_dir, ids, llm.generate(ids, GREEDY))
        for rank, params in enumerate(llm.core.executor.named_parameters()):  # each rank: its shard only
            q = new["model.layers.0.self_attn.q_proj.weight"].chunk(2, 0)[rank]
            assert torch.equal(params["model.layers.0.self_attn.qkv_proj.weight"][: q.shape[0]], q)
            down = new["model.layers.1.mlp.down_proj.weight"].chunk(2, 1)[rank]
            assert torch.equal(params["model.layers.1.mlp.down_proj.weight"], down)

        bad = [(n, t[:-1] if n.endswith("o_proj.weight") else t) for n, t in new.items()]
        with pytest.raises(ModelLoadError, match=r"o_proj\.weight.*shape"):
            llm.update_weights_from_tensors(bad)
        assert llm.weight_version == "1"
        assert_equals_hf(new_dir, ids, llm.generate(ids, GREEDY))  # the group lives on, unchanged

        llm.update_weights_from_tensors(list(load_file(old_dir / "model.safetensors").items()))
        assert_equals_hf(old_dir, ids, llm.generate(ids, GREEDY))

        trainer = trainer_factory(old_dir, tmp_path, world_size=3, bucket_bytes=128 * 1024, flat=True)
        llm.init_weights_update_group("127.0.0.1", trainer.port, 1, 3, "rl")  # ranks 1 and 2
        meta = trainer.metadata()
        version = llm.update_weights_from_distributed(
            meta["names"], meta["dtypes"], meta["shapes"], bucket_bytes=meta["bucket_bytes"]
        )
        trainer.join()
        llm.destroy_weights_update_group("rl")
        outputs = llm.generate(ids, GREEDY)
        assert_equals_hf(tmp_path, ids, outputs)
        assert {o.weight_version for o in outputs} == {version} == {"3"}

        kv_bytes, weight_bytes = llm.core.weights.memory_bytes()
        llm.sleep(1)
        assert llm.core.weights.memory_bytes() == (0, weight_bytes)
        llm.wake_up()
        assert llm.core.weights.memory_bytes() == (kv_bytes, weight_bytes)
        assert_equals_hf(tmp_path, ids, llm.generate(ids, GREEDY))
        llm.core.check_integrity()
    finally:
        llm.shutdown()
