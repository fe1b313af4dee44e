"""The Llama family: Llama (incl. GQA and Llama 3 RoPE scaling), Mistral, Qwen2 (q/k/v
bias) and Qwen3 (RMSNorm on q and k heads). Module names match Hugging Face checkpoints,
with q/k/v and gate/up merged into one column-parallel projection each."""

from __future__ import annotations

import torch
from baton.kernels import ops
from baton.kernels.ops import KernelImpl
from torch import nn

from .attention import Attention, AttentionBackend, AttentionMetadata
from .config import ModelArch
from .embedding import ParallelLMHead, VocabParallelEmbedding
from .layernorm import RMSNorm
from .linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from .parallel import TPGroup
from .rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        impl: KernelImpl,
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads, arch.qkv_bias, tp, dtype, device
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = arch.head_dim
        self.o_proj = RowParallelLinear(
            arch.num_heads * arch.head_dim, arch.hidden_size, arch.o_bias, tp, dtype, device
        )
        self.q_norm = self.k_norm = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype, device, impl)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype, device, impl)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, arch.head_dim, self.num_kv_heads, backend)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        out = self.attn(q, k, v, kv_cache, metadata, rotary=self.rotary, positions=positions)
        return self.o_proj(out.reshape(num_tokens, q_size))


class LlamaMLP(nn.Module):
    def __init__(
        self, arch: ModelArch, tp: TPGroup, dtype: torch.dtype, device: torch.device, impl: KernelImpl = "auto"
    ) -> None:
        super().__init__()
        self.impl = impl
        size = arch.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(arch.hidden_size, [size, size], arch.mlp_bias, tp, dtype, device)
        self.down_proj = RowParallelLinear(size, arch.hidden_size, arch.mlp_bias, tp, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x), impl=self.impl))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        impl: KernelImpl,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, rotary, backend, tp, dtype, device, impl)
        self.mlp = LlamaMLP(arch, tp, dtype, device, impl)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device, impl)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device, impl)

    def forward(self, positions, hidden, residual, kv_cache, metadata):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        backend: AttentionBackend,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        impl: KernelImpl,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp, dtype, device)
        rotary = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling, device, impl
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, rotary, backend, tp, dtype, device, impl) for _ in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device, impl)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], metadata: AttentionMetadata):
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # Checkpoint names that load into a merged parameter: (ours, shard id).
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        arch: ModelArch,
        backend: AttentionBackend,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        impl: KernelImpl = "auto",
    ) -> None:
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch, backend, tp, dtype, device, impl)
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, tp, dtype, device)
        if arch.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """Maps a checkpoint tensor name to (our parameter name, shard id or None)."""
        for source, (target, shard_id) in self.stacked_params.items():
            if f".{source}." in name:
                return name.replace(f".{source}.", f".{target}."), shard_id
        return name, None
