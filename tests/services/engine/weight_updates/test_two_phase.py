"""Two-phase updates (prepare, then commit or discard), through `LLM`: a prepared update
changes nothing until its commit, a corrupt folder is refused in prepare, and a write that
fails part-way never leaves half-written weights serving."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from baton.services.engine import LLM, ModelLoadError, SamplingParams
from baton.services.engine.errors import EngineSleepingError
from safetensors.torch import load_file
from testlib.weight_updates import MAX_TOKENS, PROMPTS, assert_equals_hf

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1)


@pytest.fixture
def llm(old_dir):
    llm = LLM(model=str(old_dir), num_kv_blocks=64, block_size=16)
    yield llm
    llm.shutdown()


def prompt_ids(llm) -> list[list[int]]:
    return [llm.tokenizer.encode(p) for p in PROMPTS]


def assert_unchanged(llm, old_dir) -> None:
    """Still version "0" on the old weights, nothing staged, every block free."""
    ids = prompt_ids(llm)
    outputs = llm.generate(ids, GREEDY)
    assert_equals_hf(old_dir, ids, outputs)
    assert llm.weight_version == "0" and {o.weight_version for o in outputs} == {"0"}
    assert llm.core.executor.rank.weights.prepared is None
    with pytest.raises(RuntimeError, match="no update is prepared"):
        llm.commit_prepared_weights()
    llm.core.check_integrity()
    assert llm.core.scheduler.kv.num_free_blocks == llm.core.num_kv_blocks


def _rewrite_header(path, edit) -> None:
    """Applies `edit` to a safetensors file's JSON header (same length: the data stays put)."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    edit(header)
    encoded = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    assert len(encoded) == size
    path.write_bytes(data[:8] + encoded + data[8 + size :])


def test_prepare_then_commit_equals_an_update_from_disk(llm, old_dir, new_dir):
    ids = prompt_ids(llm)
    llm.prepare_weights_from_disk(str(new_dir))
    assert_equals_hf(old_dir, ids, llm.generate(ids, GREEDY))  # prepared is not live
    assert llm.weight_version == "0"
    assert llm.commit_prepared_weights(weight_version="step-1") == "step-1"
    after = llm.generate(ids, GREEDY)
    assert_equals_hf(new_dir, ids, after)
    assert {o.weight_version for o in after} == {"step-1"}
    assert llm.core.executor.rank.weights.prepared is None  # the staged copy is gone
    with pytest.raises(RuntimeError, match="no update is prepared"):
        llm.commit_prepared_weights()  # one commit per prepare


def test_prepare_then_discard_changes_nothing(llm, old_dir, new_dir):
    llm.prepare_weights_from_disk(str(new_dir))
    llm.discard_prepared_weights()
    assert_unchanged(llm, old_dir)


def test_a_truncated_file_is_refused_in_prepare(llm, old_dir, new_dir, tmp_path):
    broken = tmp_path / "truncated"
    shutil.copytree(new_dir, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated.*not a readable safetensors file"):
        llm.prepare_weights_from_disk(str(broken))
    assert_unchanged(llm, old_dir)


def test_a_corrupt_header_is_refused_in_prepare_by_tensor_name(llm, old_dir, new_dir, tmp_path):
    """A dtype flipped to an integer one of the same width: every shape still matches, and the
    bytes would have been cast into nonsense weights."""
    broken = tmp_path / "corrupt"
    shutil.copytree(new_dir, broken)
    bad = "model.layers.1.mlp.down_proj.weight"
    _rewrite_header(broken / "model.safetensors", lambda header: header[bad].update(dtype="I32"))
    with pytest.raises(ModelLoadError, match=r"down_proj\.weight.*int32, not a floating-point"):
        llm.prepare_weights_from_disk(str(broken))
    with pytest.raises(ModelLoadError, match=r"down_proj\.weight.*int32"):
        llm.update_weights_from_disk(str(broken))  # the one-call form prepares first too
    assert_unchanged(llm, old_dir)


def test_a_refused_prepare_drops_the_update_prepared_before(llm, old_dir, new_dir, tmp_path):
    """A failed prepare leaves nothing staged: a commit after it cannot apply an older folder."""
    llm.prepare_weights_from_disk(str(new_dir))
    missing = tmp_path / "missing"
    with pytest.raises(ModelLoadError):
        llm.prepare_weights_from_disk(str(missing))
    assert_unchanged(llm, old_dir)


def test_prepared_tensors_commit_like_an_update_from_tensors(llm, old_dir, new_dir):
    named = list(load_file(new_dir / "model.safetensors").items())
    with pytest.raises(ModelLoadError, match="meta device"):
        llm.prepare_weights_from_tensors([*named[:-1], (named[-1][0], named[-1][1].to("meta"))])
    assert_unchanged(llm, old_dir)
    llm.prepare_weights_from_tensors(named)
    assert llm.commit_prepared_weights() == "1"
    ids = prompt_ids(llm)
    assert_equals_hf(new_dir, ids, llm.generate(ids, GREEDY))


def test_a_write_that_fails_part_way_releases_the_weights(llm, new_dir):
    """Nothing a caller can pass fails the write (prepare checks it all), so the staged copy
    is given a tensor past those checks, last: the tensors before it are already written
    when it fails. The engine must then refuse requests, not serve half-new weights."""
    named = list(load_file(new_dir / "model.safetensors").items())
    rank = llm.core.executor.rank
    llm.prepare_weights_from_tensors(named)
    name, tensor = rank.weights.prepared[-1]
    rank.weights.prepared[-1] = (name, torch.empty(tensor.shape, device="meta"))
    with pytest.raises(Exception, match="meta"):
        llm.commit_prepared_weights()
    assert llm.weight_version == "0"
    with pytest.raises(EngineSleepingError, match="update_weights_from"):
        llm.generate(["A"], GREEDY)
    assert llm.update_weights_from_disk(str(new_dir)) == "1"  # a complete update brings them back
    ids = prompt_ids(llm)
    assert_equals_hf(new_dir, ids, llm.generate(ids, GREEDY))


async def test_the_two_phases_through_async_llm(old_dir, new_dir):
    from baton.services.engine import AsyncLLM

    engine = AsyncLLM.from_kwargs(str(old_dir), num_kv_blocks=64)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]

    async def generate(tag: str) -> list:
        return [[o async for o in engine.generate(f"{tag}-{i}", p, GREEDY)][-1] for i, p in enumerate(ids)]

    try:
        await engine.prepare_weights_from_disk(str(new_dir))
        await engine.discard_prepared_weights()
        with pytest.raises(RuntimeError, match="no update is prepared"):
            await engine.commit_prepared_weights()
        assert_equals_hf(old_dir, ids, await generate("discarded"))
        await engine.prepare_weights_from_disk(str(new_dir))
        assert await engine.commit_prepared_weights(weight_version="v1") == "v1"
        outputs = await generate("committed")
        assert_equals_hf(new_dir, ids, outputs)
        assert {o.weight_version for o in outputs} == {"v1"}
    finally:
        engine.shutdown()
