"""Engine start-up: cross-field checks against the model, the context limit, the executor,
and the speculator (with its draft model)."""

from __future__ import annotations

import logging
from typing import Any

from ..model.config import ModelArch, load_model_arch
from .api.tokenizer import load_tokenizer
from .config import EngineConfig
from .execution.executor import Executor, UniProcExecutor
from .execution.model_rank import resolve_device, resolve_dtype
from .execution.sampler import Sampler
from .spec_decode.draft_blocks import DraftBlockPool
from .spec_decode.draft_proposer import DraftProposer
from .spec_decode.draft_runner import DraftRunner
from .spec_decode.drafter import Drafter
from .spec_decode.eagle_model import load_eagle_drafter
from .spec_decode.eagle_proposer import EagleProposer
from .spec_decode.eagle_runner import EagleRunner
from .spec_decode.medusa_heads import load_medusa_heads
from .spec_decode.medusa_proposer import MedusaProposer
from .spec_decode.speculator import Speculator

logger = logging.getLogger(__name__)


def create_executor(config: EngineConfig, arch: ModelArch) -> Executor:
    if config.parallel.tensor_parallel_size == 1:
        return UniProcExecutor(config, arch)
    from .execution.tp_executor import RayTPExecutor  # imports Ray only when TP > 1

    return RayTPExecutor(config, arch)


def check_engine_config(config: EngineConfig, arch: ModelArch) -> None:
    """Cross-field checks that need the model's own config."""
    tp = config.parallel.tensor_parallel_size
    if arch.num_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {arch.num_heads} attention heads")
    if arch.num_kv_heads % tp and tp % arch.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp} and the model's {arch.num_kv_heads} KV heads: one must divide the other"
        )
    if config.model.max_model_len and config.model.max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len {config.model.max_model_len} exceeds the model's "
            f"max_position_embeddings ({arch.max_position_embeddings})"
        )
    if config.runner.cuda_graphs:
        if tp > 1:  # a graph would have to capture the ranks' all-reduces, each in its own process
            raise ValueError(f"cuda_graphs runs one rank; tensor_parallel_size is {tp}")
        device = resolve_device(config.runner.device)
        if device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device; runner.device {config.runner.device!r} is {device}")


def resolve_max_model_len(config: EngineConfig, arch: ModelArch, num_kv_blocks: int) -> int:
    """The context limit: asked for, else the model's own (capped by a sliding window and by
    what the KV cache can hold, with a warning)."""
    capacity = num_kv_blocks * config.cache.block_size
    if config.model.max_model_len is not None:
        if config.model.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {config.model.max_model_len} needs {config.model.max_model_len} KV slots "
                f"but the cache holds {capacity} ({num_kv_blocks} blocks of {config.cache.block_size}); "
                "raise the KV budget or lower max_model_len"
            )
        return config.model.max_model_len
    limit = arch.max_position_embeddings
    if arch.sliding_window:
        limit = min(limit, arch.sliding_window)
    if limit > capacity:
        logger.warning("context limit lowered from %d to %d tokens: that is all the KV cache holds", limit, capacity)
        limit = capacity
    return limit


def create_speculator(
    config: EngineConfig, arch: ModelArch, tokenizer: Any, max_model_len: int, num_kv_blocks: int
) -> Speculator | None:
    """The speculator `engine.speculative` asks for (medusa and eagle: create_head_drafter);
    with method draft_model, the draft is
    checked against the target and loaded here, at TP 1 in this process (on the device the
    runner setting names), with its own KV cache of `draft_num_kv_blocks` blocks (default:
    the target's count, so it holds as many tokens)."""
    spec = config.speculative
    if not spec.enabled:
        return None
    if spec.method == "ngram":
        return Speculator(spec, max_model_len)
    if spec.method in ("medusa", "eagle"):
        return Speculator(spec, max_model_len, create_head_drafter(config, arch, max_model_len, num_kv_blocks))
    draft_arch = load_model_arch(spec.draft_model)
    check_draft_model(spec.draft_model, draft_arch, arch, tokenizer, max_model_len)
    device = resolve_device(config.runner.device)
    num_draft_blocks = spec.draft_num_kv_blocks or num_kv_blocks
    runner = DraftRunner(
        spec.draft_model,
        draft_arch,
        resolve_dtype(config.model.dtype, draft_arch, device),
        device,
        config.cache.block_size,
        config.runner.kernel_backend,
        num_draft_blocks,
    )
    pool = DraftBlockPool(num_draft_blocks)
    drafter = DraftProposer(runner, pool, Sampler(arch.eos_token_ids))
    return Speculator(spec, max_model_len, drafter)


def check_draft_model(
    draft_dir: str, draft_arch: ModelArch, arch: ModelArch, tokenizer: Any, max_model_len: int
) -> None:
    """The draft must share the target's vocabulary (q and p are compared token by token)
    and its tokenizer (the same ids must mean the same text), and reach the context limit."""
    if draft_arch.vocab_size != arch.vocab_size:
        raise ValueError(
            f"speculative.draft_model {draft_dir} has vocab_size {draft_arch.vocab_size}, the target "
            f"{arch.vocab_size}: the draft must share the target's vocabulary"
        )
    draft_tokenizer = load_tokenizer(draft_dir)
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"speculative.draft_model {draft_dir} has another tokenizer than the target (their vocabularies "
            "map tokens to different ids)"
        )
    if draft_arch.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative.draft_model {draft_dir} reaches {draft_arch.max_position_embeddings} positions, "
            f"fewer than max_model_len {max_model_len}: lower max_model_len or pick another draft"
        )


def create_head_drafter(config: EngineConfig, arch: ModelArch, max_model_len: int, num_kv_blocks: int) -> Drafter:
    """Medusa heads or an EAGLE drafter from `speculative.heads`, checked against the target
    and loaded in this process in the target's dtype; they draft from the hidden states rank 0
    hands back each step (any tensor-parallel size). The EAGLE drafter's own KV cache holds
    `draft_num_kv_blocks` blocks (default: the target's count)."""
    spec = config.speculative
    device = resolve_device(config.runner.device)
    dtype = resolve_dtype(config.model.dtype, arch, device)
    sampler = Sampler(arch.eos_token_ids)
    if spec.method == "medusa":
        heads = load_medusa_heads(spec.heads, dtype, device, config.runner.kernel_backend)
        check_head_shapes(spec.heads, heads.hidden_size, heads.vocab_size, arch)
        if spec.num_speculative_tokens > heads.num_heads:
            raise ValueError(
                f"num_speculative_tokens {spec.num_speculative_tokens} exceeds the {heads.num_heads} Medusa heads "
                f"of speculative.heads {spec.heads} (head i drafts position i + 1)"
            )
        return MedusaProposer(heads, sampler, device)
    drafter = load_eagle_drafter(spec.heads, config.model.model, arch, dtype, device, config.runner.kernel_backend)
    if drafter.arch.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative.heads {spec.heads} reaches {drafter.arch.max_position_embeddings} positions, fewer than "
            f"max_model_len {max_model_len}"
        )
    num_blocks = spec.draft_num_kv_blocks or num_kv_blocks
    runner = EagleRunner(drafter, config.cache.block_size, num_blocks, device)
    return EagleProposer(runner, DraftBlockPool(num_blocks), sampler)


def check_head_shapes(heads_dir: str, hidden_size: int, vocab_size: int, arch: ModelArch) -> None:
    """Heads read the target's hidden states and propose from its vocabulary."""
    if hidden_size != arch.hidden_size:
        raise ValueError(
            f"speculative.heads {heads_dir} has hidden_size {hidden_size}, the target {arch.hidden_size}: "
            "the heads read the target's hidden states"
        )
    if vocab_size != arch.vocab_size:
        raise ValueError(
            f"speculative.heads {heads_dir} has vocab_size {vocab_size}, the target {arch.vocab_size}: "
            "the heads must share the target's vocabulary"
        )
