"""The engine's typed configuration: one frozen pydantic model per component.

`EngineConfig` groups them; each component receives only its own section (the scheduler
gets `SchedulerConfig`, the KV-cache manager `CacheConfig`, ...). The same models are
sections of the service YAML (`configs/*.yaml`), so a field documented here is documented
there. Checks that need the model's own config (heads, context length) run when the engine
starts, in `resolve_engine_config`.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..kv_transfer.config import KVTransferConfig

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(BaseModel):
    model_config = _FROZEN

    model: str = Field(description="Path to a Hugging Face model folder (config.json, safetensors, tokenizer)")
    tokenizer: str | None = Field(None, description="Tokenizer folder, if not the model folder")
    served_model_name: str | None = Field(None, description="Name clients use; defaults to the folder name")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype; auto takes config.json's torch_dtype (float32 on CPU)"
    )
    max_model_len: int | None = Field(
        None, ge=2, description="Context limit (prompt + output); defaults to the model's own"
    )
    quantization: Literal["int8", "w8a8"] | None = Field(
        None,
        description="int8: weight-only int8 linear layers and LM head (symmetric, one scale per output channel), "
        "float checkpoints quantized at load, activations in `dtype`; w8a8: the same int8 weights, and the "
        "linear layers' activations quantized to int8 per token on every call (the LM head stays weight-only; "
        "CPU only, fast with AVX512-VNNI or AVX2, model/w8a8_linear.py); None: as the checkpoint stores them (a "
        "compressed-tensors W8A16 checkpoint loads int8, a W8A8 one w8a8, model/compressed_tensors.py; int8 "
        "runs a W8A8 checkpoint weight-only)",
    )
    seed: int = Field(0, description="Seed for weights-independent randomness (unseeded requests)")
    max_logprobs: int = Field(20, ge=0, description="Largest `logprobs` a request may ask for")


class CacheConfig(BaseModel):
    model_config = _FROZEN

    block_size: int = Field(16, description="Tokens per KV-cache block (a power of two, 1..256)")
    num_kv_blocks: int | None = Field(
        None, ge=1, description="Number of KV-cache blocks; overrides the memory budget below"
    )
    kv_cache_memory_bytes: int | None = Field(None, ge=1, description="Memory for the KV cache; default 512 MiB on CPU")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="On CUDA without an explicit budget: fraction of device memory to use"
    )
    kv_cache_dtype: Literal["auto", "bfloat16"] = Field(
        "auto",
        description="auto: the KV cache holds the model's dtype. bfloat16: a float32 model keeps its K/V in "
        "bfloat16, half the bytes: twice the blocks in the same memory and half the cache reads of decode "
        "attention, which computes in float32 still; K/V are rounded to bfloat16 when written (outputs differ "
        "slightly from float32's). Prefill and decode services must agree (the handover copies raw bytes)",
    )
    enable_prefix_caching: bool = Field(True, description="Reuse cached KV blocks across requests")
    warm_window_s: float = Field(
        30.0,
        gt=0,
        description="A free block whose cached prefix was in use within this many seconds counts as warm in load "
        "reports; routers charge a placement for the warm blocks it would evict",
    )

    @model_validator(mode="after")
    def _block_size_is_power_of_two(self) -> CacheConfig:
        if not (1 <= self.block_size <= 256 and self.block_size & (self.block_size - 1) == 0):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size}")
        return self


class SchedulerConfig(BaseModel):
    model_config = _FROZEN

    max_num_seqs: int = Field(128, ge=1, description="Most requests running in one step")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Token budget of one step")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across steps, interleaved with decodes")
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="Cap on one request's prefill chunk per step (0: no cap)"
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="Tokens a streamed request gathers before its next output (the first and the last go at "
        "once); more per output costs less per token in every hop to the client, as vLLM's --stream-interval",
    )


class ParallelConfig(BaseModel):
    model_config = _FROZEN

    tensor_parallel_size: int = Field(1, ge=1, description="Ranks holding the model's shards")
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="Ray placement-group strategy for the TP ranks"
    )
    rank_timeout_s: float = Field(
        120.0, gt=0, description="A step that takes longer than this marks the rank group dead"
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        # "worker" names a Serve engine replica; a TP shard is a rank (docs/architecture.md).
        if isinstance(data, dict) and "worker_timeout_s" in data:
            warnings.warn("parallel.rank_timeout_s is deprecated: write rank_timeout_s", FutureWarning, stacklevel=2)
            data = {**data}
            data.setdefault("rank_timeout_s", data.pop("worker_timeout_s"))
        return data


class RunnerConfig(BaseModel):
    model_config = _FROZEN

    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when available")
    kernel_backend: Literal["auto", "torch", "triton", "cpp"] = Field(
        "auto",
        description="Kernels. auto: Triton on CUDA; on CPU Baton's blocked linear weights (float32; bfloat16 "
        "without AMX; oneDNN-packed otherwise) and the C++ decode and prefill attention (built at start-up; the "
        "torch references where they cannot be built). cpp: as auto on "
        "CPU, but failing at start-up without the C++ kernel. torch: torch references and F.linear throughout",
    )
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's)")
    peak_tflops: float | None = Field(
        None, gt=0, description="Device peak dense TFLOP/s for MFU (default: known GPUs; else MFU is not reported)"
    )
    peak_memory_tbs: float | None = Field(
        None, gt=0, description="Device peak memory bandwidth in TB/s for MBU (default: known GPUs)"
    )
    core_process: bool | None = Field(
        None,
        description="AsyncLLM runs the engine core and its step loop in a child process of its own, as vLLM's "
        "engine core runs, rather than on a thread of the caller's process: the steps then share no GIL with the "
        "serving layer's event loop, Ray's threads and the router agent. Needs tensor_parallel_size 1 (the "
        "ranks of a larger one are Ray actors, which a child process cannot place). Default: on in serving "
        "replicas with one rank, off where AsyncLLM is built directly",
    )
    cuda_graphs: bool = Field(
        False,
        description="On CUDA, decode-only steps replay a CUDA graph captured for their batch size (padded up to "
        "the next of 1, 2, 4, 8, 16, 24, 32, ...), which saves the per-kernel launch cost of the step; captured "
        "at start-up and again after a weight update or sleep moves the weights or the KV cache. Needs the "
        "Triton kernels and one rank (tensor_parallel_size 1)",
    )
    cuda_graph_max_batch_size: int | None = Field(
        None,
        ge=1,
        description="cuda_graphs: the largest decode batch (rows: requests, plus their drafts when speculating) "
        "that replays a graph; larger ones run eagerly (default: scheduler.max_num_seqs)",
    )

    @model_validator(mode="after")
    def _cuda_graphs(self) -> RunnerConfig:
        if not self.cuda_graphs:
            if self.cuda_graph_max_batch_size is not None:
                raise ValueError("cuda_graph_max_batch_size is set but cuda_graphs is off: set cuda_graphs: true")
            return self
        if self.device == "cpu":
            raise ValueError("cuda_graphs needs a CUDA device; runner.device is 'cpu'")
        if self.kernel_backend in ("torch", "cpp"):
            raise ValueError(
                f"cuda_graphs needs the Triton kernels (kernel_backend auto or triton), not {self.kernel_backend!r}: "
                "the torch references read tensors back to the host, which a graph cannot capture"
            )
        return self


class StructuredOutputConfig(BaseModel):
    model_config = _FROZEN

    compile_timeout_s: float = Field(
        10.0, gt=0, description="A grammar that takes longer to compile fails its request (400)"
    )
    num_compile_threads: int = Field(1, ge=1, description="Threads compiling grammars beside the engine loop")
    grammar_cache_size: int = Field(
        256, ge=0, description="Compiled grammars kept for reuse, keyed by kind, spec and whitespace"
    )


class SpeculativeConfig(BaseModel):
    """Speculative decoding where this engine decodes (colocated, or the decode service)."""

    model_config = _FROZEN

    method: Literal["ngram", "draft_model", "medusa", "eagle"] | None = Field(
        None,
        description="ngram: prompt lookup over the request's own tokens, no extra model. draft_model: a smaller "
        "model with the target's tokenizer drafts k tokens autoregressively. medusa: Medusa heads on the "
        "target's last hidden state draft k tokens at once. eagle: an EAGLE-1 one-layer drafter on the target's "
        "hidden states drafts k tokens autoregressively. None: off",
    )
    num_speculative_tokens: int = Field(3, ge=1, description="Draft tokens verified per request per step (k)")
    prompt_lookup_min: int = Field(2, ge=1, description="ngram: the shortest suffix n-gram to look up")
    prompt_lookup_max: int = Field(5, ge=1, description="ngram: the longest suffix n-gram to look up")
    draft_model: str | None = Field(
        None,
        description="draft_model: a Hugging Face folder with the target's vocabulary and tokenizer; it runs at "
        "tensor-parallel size 1 in the engine's process, with its own KV cache",
    )
    draft_num_kv_blocks: int | None = Field(
        None,
        ge=1,
        description="draft_model, eagle: blocks of the drafter's own KV cache (default: as many as the target's)",
    )
    heads: str | None = Field(
        None,
        description="medusa, eagle: the folder of the heads that draft from the target's hidden states, in the "
        "layout of their public checkpoints (docs/architecture.md, speculative decoding): Medusa heads "
        "(config.json with medusa_num_heads, medusa_num_layers) or an EAGLE-1 drafter (a one-layer LlamaConfig)",
    )

    @model_validator(mode="after")
    def _lookup_bounds(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("draft_model: method 'draft_model' needs the draft's Hugging Face folder")
        if self.method != "draft_model" and self.draft_model:
            raise ValueError(f"draft_model is set but method is {self.method!r}: write method: draft_model")
        if self.draft_num_kv_blocks and self.method not in ("draft_model", "eagle"):
            raise ValueError(f"draft_num_kv_blocks is set but method is {self.method!r}: it sizes a drafter's KV cache")
        if self.method in ("medusa", "eagle") and not self.heads:
            raise ValueError(f"heads: method {self.method!r} needs the folder of its heads")
        if self.method not in ("medusa", "eagle") and self.heads:
            raise ValueError(f"heads is set but method is {self.method!r}: write method: medusa or eagle")
        return self

    @property
    def enabled(self) -> bool:
        return self.method is not None


class EngineConfig(BaseModel):
    model_config = _FROZEN

    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    runner: RunnerConfig = RunnerConfig()
    kv_transfer: KVTransferConfig = KVTransferConfig()
    structured_output: StructuredOutputConfig = StructuredOutputConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()

    @model_validator(mode="after")
    def _w8a8_on_the_cpu(self) -> EngineConfig:
        if self.model.quantization == "w8a8" and self.runner.device == "cuda":
            raise ValueError(
                "quantization w8a8 runs on the CPU only (its kernel is an x86 one); runner.device is 'cuda': "
                "use quantization int8 (weight-only) on GPUs"
            )
        return self

    @model_validator(mode="after")
    def _kv_cache_dtype(self) -> EngineConfig:
        if self.cache.kv_cache_dtype == "bfloat16" and self.model.dtype == "float16":
            raise ValueError(
                "cache.kv_cache_dtype bfloat16 needs a float32 or bfloat16 model, not dtype float16: the kernels "
                "widen a bfloat16 cache only for float32 activations"
            )
        return self

    @model_validator(mode="after")
    def _core_process(self) -> EngineConfig:
        tp = self.parallel.tensor_parallel_size
        if self.runner.core_process and tp > 1:
            raise ValueError(
                f"runner.core_process needs tensor_parallel_size 1 (it is {tp}): the ranks of a sharded engine "
                "are Ray actors in the replica's placement group, which a child process cannot join"
            )
        return self

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Builds the config from flat keyword arguments, as `LLM(model=..., block_size=...)`."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        for key, value in kwargs.items():
            section, field = _FLAT_ALIASES.get(key, (_FIELD_TO_SECTION.get(key), key))
            if section is None:
                raise TypeError(f"unknown engine argument {key!r}")
            sections[section][field] = value
        return cls(**{name: _SECTIONS[name](**values) for name, values in sections.items()})


_SECTIONS: dict[str, type[BaseModel]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "runner": RunnerConfig,
    "kv_transfer": KVTransferConfig,
    "structured_output": StructuredOutputConfig,
    "speculative": SpeculativeConfig,
}
_FIELD_TO_SECTION = {field: section for section, model in _SECTIONS.items() for field in model.model_fields}
_FIELD_TO_SECTION["worker_timeout_s"] = "parallel"  # the old name of rank_timeout_s
# Flat names that would be ambiguous without their section: LLM(..., speculative_method="ngram").
_FLAT_ALIASES = {"speculative_method": ("speculative", "method")}
_FIELD_TO_SECTION.pop("method")
