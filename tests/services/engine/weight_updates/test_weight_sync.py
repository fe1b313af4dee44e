"""The trainer path: a real trainer process, rank 0 of a gloo group, takes a gradient step
and broadcasts its weights in buckets; the engine's outputs then equal Hugging Face on the
trainer's saved weights, through LLM and AsyncLLM."""

from __future__ import annotations

import pytest
import torch
from baton.services.engine import LLM, AsyncLLM, SamplingParams
from baton.services.engine.errors import EngineSleepingError
from baton.services.engine.execution.weight_sync import (
    FlatWeights,
    WeightSyncGroup,
    as_dtype,
    core_left_for_receiving,
    plan_buckets,
)
from testlib.weight_updates import MAX_TOKENS, PROMPTS, assert_equals_hf, free_port

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1)


def test_buckets_group_by_dtype_and_cap_their_size():
    names = ["a", "b", "c", "d", "e"]
    dtypes = [torch.float32, "bfloat16", "torch.float32", torch.float32, torch.float32]
    shapes = [[4], [2], [2, 4], [100], [3]]
    buckets = plan_buckets(names, dtypes, shapes, bucket_bytes=64)
    assert [(b.dtype, [e.name for e in b.entries]) for b in buckets] == [
        (torch.float32, ["a", "c"]),  # 48 bytes; d would overflow 64
        (torch.float32, ["d"]),  # larger than a bucket: alone
        (torch.float32, ["e"]),
        (torch.bfloat16, ["b"]),
    ]
    assert [(e.offset, e.numel) for e in buckets[0].entries] == [(0, 4), (4, 8)]
    assert as_dtype("torch.bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="twice"):
        plan_buckets(["a", "a"], dtypes[:2], shapes[:2])


def test_flat_weights_live_in_their_buckets():
    named = [("a", torch.randn(4, 2)), ("b", torch.randn(3).bfloat16()), ("c", torch.randn(5))]
    flat = FlatWeights(named, bucket_bytes=1 << 20)
    assert [f.numel() for f in flat.flats] == [13, 3]  # float32 a + c, then bfloat16 b
    for name, tensor in named:
        assert torch.equal(flat.tensors[name], tensor)
    flat.tensors["c"].add_(1)  # a trainer's in-place step lands in the bucket it sends
    assert torch.equal(flat.flats[0][8:], named[2][1] + 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_nccl_without_cuda_is_refused_naming_the_backend(old_dir):
    """Refused before any rendezvous: nobody waits for a group that cannot form."""
    with pytest.raises(ValueError, match="backend 'nccl' needs CUDA.*use backend 'gloo'"):
        WeightSyncGroup("127.0.0.1", 1, 0, 2, "rl", backend="nccl")  # port 1: never reached
    with pytest.raises(ValueError, match="'gloo' and 'nccl'.*'mpi'"):
        WeightSyncGroup("127.0.0.1", 1, 0, 2, "rl", backend="mpi")
    llm = LLM(model=str(old_dir), num_kv_blocks=64)
    try:
        with pytest.raises(ValueError, match="backend 'nccl' needs CUDA"):
            llm.init_weights_update_group("127.0.0.1", 1, 1, 2, "rl", backend="nccl")
        with pytest.raises(ValueError, match="no weight update group"):
            llm.destroy_weights_update_group("rl")  # the refused group was never made
    finally:
        llm.shutdown()


def test_a_gloo_group_receives_into_host_memory_and_leaves_its_thread_a_core():
    port = free_port()
    group = WeightSyncGroup("127.0.0.1", port, 0, 1, "solo", device="cuda")  # gloo: host buffers
    assert group.device == torch.device("cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with core_left_for_receiving(group):  # the writes leave gloo's receiving thread a core
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
        group.destroy()


def test_update_from_a_trainer_process_equals_hf(old_dir, tmp_path, trainer_factory):
    llm = LLM(model=str(old_dir), num_kv_blocks=64)
    try:
        ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        before = llm.generate(ids, GREEDY)
        trainer = trainer_factory(old_dir, tmp_path, world_size=2, bucket_bytes=64 * 1024)  # many buckets
        llm.init_weights_update_group("127.0.0.1", trainer.port, 1, 2, "rl")
        meta = trainer.metadata()
        version = llm.update_weights_from_distributed(
            meta["names"], meta["dtypes"], meta["shapes"], weight_version="trained-1", bucket_bytes=meta["bucket_bytes"]
        )
        trainer.join()
        llm.destroy_weights_update_group("rl")
        assert version == "trained-1"
        after = llm.generate(ids, GREEDY)
        assert_equals_hf(tmp_path, ids, after)
        assert [o.token_ids for o in after] != [o.token_ids for o in before]
        assert {o.weight_version for o in after} == {"trained-1"}
        with pytest.raises(ValueError, match="no weight update group"):
            llm.destroy_weights_update_group("rl")
    finally:
        llm.shutdown()


def test_a_trainer_lost_mid_transfer_leaves_no_half_updated_model(old_dir, new_dir, tmp_path, trainer_factory):
    """Buckets are written as they arrive: when the trainer dies after the first one, the
    weights are released (requests refused, version unchanged) until a complete update."""
    llm = LLM(model=str(old_dir), num_kv_blocks=64)
    try:
        trainer = trainer_factory(old_dir, tmp_path, world_size=2, bucket_bytes=64 * 1024, die_after=2)
        llm.init_weights_update_group("127.0.0.1", trainer.port, 1, 2, "rl")
        meta = trainer.metadata()
        with pytest.raises(RuntimeError):
            llm.update_weights_from_distributed(
                meta["names"], meta["dtypes"], meta["shapes"], bucket_bytes=meta["bucket_bytes"]
            )
        trainer.join(returncode=3)
        assert llm.weight_version == "0"
        with pytest.raises(EngineSleepingError, match="update_weights_from"):
            llm.generate(["A"], GREEDY)
        llm.destroy_weights_update_group("rl")
        llm.update_weights_from_disk(str(new_dir))
        ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        assert_equals_hf(new_dir, ids, llm.generate(ids, GREEDY))
    finally:
        llm.shutdown()


async def test_each_kind_of_update_through_async_llm(old_dir, new_dir, tmp_path, trainer_factory):
    from safetensors.torch import load_file

    engine = AsyncLLM.from_kwargs(str(old_dir), num_kv_blocks=64)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]

    async def generate() -> list:
        outputs = []
        for i, prompt in enumerate(ids):
            outputs.append([o async for o in engine.generate(f"{engine.weight_version}-{i}", prompt, GREEDY)][-1])
        return outputs

    try:
        assert await engine.update_weights_from_disk(str(new_dir)) == "1"
        assert_equals_hf(new_dir, ids, await generate())
        named = list(load_file(old_dir / "model.safetensors").items())
        assert await engine.update_weights_from_tensors(named) == "2"
        assert_equals_hf(old_dir, ids, await generate())

        trainer = trainer_factory(old_dir, tmp_path, world_size=2, bucket_bytes=1 << 20)
        await engine.init_weights_update_group("127.0.0.1", trainer.port, 1, 2, "rl")
        meta = trainer.metadata()
        await engine.update_weights_from_distributed(
            meta["names"], meta["dtypes"], meta["shapes"], group_name="rl", bucket_bytes=meta["bucket_bytes"]
        )
        trainer.join()
        await engine.destroy_weights_update_group("rl")
        outputs = await generate()
        assert_equals_hf(tmp_path, ids, outputs)
        assert {o.weight_version for o in outputs} == {"3"}
    finally:
        engine.shutdown()
