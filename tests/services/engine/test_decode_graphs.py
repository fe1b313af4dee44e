"""engine.runner.cuda_graphs (services/engine/execution/decode_graphs.py).

This machine has no GPU, so these tests replace CUDA's capture with one that runs the same
closure eagerly on each replay (`eager_capture`): what they check is the runner's side of a
graph, which is where it goes wrong without a GPU to say so: every input of a step reaches the
static buffers the graph reads, padding rows write no K/V, a bucket is chosen for each batch
size, and graphs are dropped when a weight or the KV cache moves. The real capture runs in
tests/kernels/test_engine_triton.py on a GPU (`make gpu-check`)."""

from __future__ import annotations

import sys

import pytest
import torch
from baton.services.engine import LLM
from baton.services.engine.config import EngineConfig, RunnerConfig
from baton.services.engine.engine_setup import check_engine_config
from baton.services.engine.execution.decode_graphs import _module_tensors, batch_buckets
from baton.services.model.attention import AttentionMetadata
from baton.services.model.config import load_model_arch
from testlib.greedy_outputs import SHRINKING_MAX_TOKENS, SHRINKING_PROMPTS, assert_same_greedy, shrinking_params


def eager_capture(fn, pool):
    """CUDA's capture, minus the GPU: replay runs fn again on whatever the static buffers hold
    now and writes the result into the same output tensor, as a graph's replay does."""
    output = fn()
    return (lambda: output.copy_(fn())), output


def make_llm(model_dir) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", num_kv_blocks=64, block_size=8, max_num_seqs=8)


def with_graphs(llm: LLM, max_batch_size: int):
    runner = llm.core.executor.rank.runner
    runner.enable_decode_graphs(max_batch_size, llm.core.max_model_len, capture=eager_capture)
    return runner.graphs


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@pytest.mark.parametrize("max_batch_size", [8, 5], ids=["all-fit", "largest-eager"])
def test_graphs_generate_what_eager_generates(model_dir, max_batch_size):
    """Decode steps of 8 down to 1 rows: with max_batch_size 5 the first decode steps (6-8
    rows) run eagerly and the later ones replay; padded buckets (7 rows in 8, 3 in 4) are
    among them. The KV caches end equal: padding rows wrote nothing, though the rows they pad
    held a larger step's slots just before."""
    eager_llm, graph_llm = make_llm(model_dir), make_llm(model_dir)
    try:
        graphs = with_graphs(graph_llm, max_batch_size)
        assert graphs.num_captures == len(batch_buckets(max_batch_size))
        expected = eager_llm.generate(SHRINKING_PROMPTS, shrinking_params())
        actual = graph_llm.generate(SHRINKING_PROMPTS, shrinking_params())
        assert_same_greedy(actual, expected, 1e-4)
        # One prefill step, then decode steps of 8, 7, 6, 5, 4, 3, 2, 2, 1, 1 rows.
        decode_rows = [sum(n - 1 >= step for n in SHRINKING_MAX_TOKENS) for step in range(1, max(SHRINKING_MAX_TOKENS))]
        assert graphs.num_replays == sum(rows <= max_batch_size for rows in decode_rows)
        eager_caches = eager_llm.core.executor.rank.runner.kv_caches
        graph_caches = graph_llm.core.executor.rank.runner.kv_caches
        for eager_kv, graph_kv in zip(eager_caches, graph_caches):
            torch.testing.assert_close(graph_kv, eager_kv, atol=1e-5, rtol=1e-5)
        graph_llm.core.check_integrity()
    finally:
        eager_llm.shutdown()
        graph_llm.shutdown()


def test_steps_the_graphs_do_not_cover_run_eagerly(llama_dir):
    llm = make_llm(llama_dir)
    try:
        graphs = with_graphs(llm, 4)
        max_blocks = graphs.block_tables.shape[1]

        def metadata(num_reqs: int, num_decodes: int, max_seq_len: int, width: int) -> AttentionMetadata:
            return AttentionMetadata(
                slot_mapping=torch.zeros(num_reqs, dtype=torch.long),
                query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32),
                seq_lens=torch.ones(num_reqs, dtype=torch.int32),
                block_tables=torch.zeros((num_reqs, width), dtype=torch.int32),
                num_decodes=num_decodes,
                max_query_len=1,
                max_seq_len=max_seq_len,
            )

        assert graphs.fits(metadata(4, 4, graphs.max_model_len, max_blocks))
        assert not graphs.fits(metadata(5, 5, 10, 2)), "past the largest bucket"
        assert not graphs.fits(metadata(3, 2, 10, 2)), "a prefill chunk in the step"
        assert not graphs.fits(metadata(2, 2, graphs.max_model_len + 1, max_blocks)), "past max_model_len"
        assert not graphs.fits(metadata(2, 2, 10, max_blocks + 1)), "a block table wider than the buffer"
    finally:
        llm.shutdown()


@pytest.mark.parametrize("level", [1, 2])
def test_moved_weights_or_kv_cache_drop_the_graphs(llama_dir, level):
    """sleep(1) frees the KV cache, sleep(2) the weights too (reloaded by an update): the
    tensors then live elsewhere, the stale graphs are dropped, and each bucket is captured
    again when a step needs it."""
    llm = make_llm(llama_dir)
    try:
        graphs = with_graphs(llm, 8)
        expected = llm.generate(SHRINKING_PROMPTS, shrinking_params())
        captured = graphs.num_captures
        llm.sleep(level)
        llm.wake_up()
        if level == 2:
            llm.update_weights_from_disk(str(llama_dir))
        assert not graphs._graphs, "graphs over freed memory must be dropped"
        assert_same_greedy(llm.generate(SHRINKING_PROMPTS, shrinking_params()), expected, 1e-4)
        assert graphs.num_captures > captured
        again = graphs.num_captures
        llm.generate(SHRINKING_PROMPTS, shrinking_params())
        assert graphs.num_captures == again, "nothing moved: the graphs are reused"
    finally:
        llm.shutdown()


def test_int8_scales_are_watched(llama_dir):
    """An int8 weight's scales are a plain tensor inside a dataclass, not a parameter: new
    scales in new memory (an update) must drop the graphs too."""
    llm = LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=64, block_size=8, quantization="int8")
    try:
        graphs = with_graphs(llm, 4)
        model = llm.core.executor.rank.runner.model
        int8 = [m.int8 for m in model.modules() if getattr(m, "int8", None) is not None]
        assert int8
        watched = {t.data_ptr() for t in _module_tensors(model)}
        assert all(w.scale.data_ptr() in watched for w in int8)
        assert not graphs.refresh(llm.core.executor.rank.runner.kv_caches)
        int8[0].scale = int8[0].scale.clone()
        assert graphs.refresh(llm.core.executor.rank.runner.kv_caches)
    finally:
        llm.shutdown()


def test_sleep_lets_go_of_the_kv_cache(llama_dir):
    llm = make_llm(llama_dir)
    try:
        graphs = with_graphs(llm, 4)
        kv = llm.core.executor.rank.runner.kv_caches[0]
        llm.sleep(1)
        assert not graphs._graphs and not graphs.kv_caches, "the graphs would keep the freed cache alive"
        assert sys.getrefcount(kv) == 2, "only this test's reference to the old cache is left"
        llm.wake_up()
    finally:
        llm.shutdown()


def test_config_refusals(llama_dir):
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device; runner.device is 'cpu'"):
        RunnerConfig(cuda_graphs=True, device="cpu")
    with pytest.raises(ValueError, match="needs the Triton kernels.*'torch'"):
        RunnerConfig(cuda_graphs=True, kernel_backend="torch")
    with pytest.raises(ValueError, match="cuda_graph_max_batch_size is set but cuda_graphs is off"):
        RunnerConfig(cuda_graph_max_batch_size=16)
    arch = load_model_arch(str(llama_dir))
    tp2 = EngineConfig.from_kwargs(model=str(llama_dir), cuda_graphs=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="cuda_graphs runs one rank; tensor_parallel_size is 2"):
        check_engine_config(tp2, arch)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device; runner.device 'auto' is cpu"):
            LLM(model=str(llama_dir), cuda_graphs=True)
