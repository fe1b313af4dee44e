"""An EAGLE-1 drafter (Li et al. 2024, github.com/SafeAILab/EAGLE): one Llama decoder layer
over the target's features. At position i it reads the next token and the target's final
hidden state there, and its output stands in for the target's hidden state at i + 1:

    x_i = fc([embed(t_{i+1}) ; h_i])        fc: 2H -> H (bias where the checkpoint has one)
    g_i = layer_0(x_i) + x_i ...            one decoder layer, no input norm (as EAGLE-1)
    logits_i = lm_head(g_i)                 the target's LM head, no final norm

The folder holds a LlamaConfig `config.json` (num_hidden_layers 1) and `*.safetensors` with
the names of the public EAGLE-1 checkpoints (yuhuili/EAGLE-*, as vLLM's EAGLE loader reads
them): `fc.weight` (`fc.bias`), `layers.0.self_attn.{q,k,v,o}_proj.weight`,
`layers.0.mlp.{gate,up,down}_proj.weight`, `layers.0.post_attention_layernorm.weight`, and
`embed_tokens.weight` where the drafter has its own; the embedding, where absent, and the LM
head always come from the target's checkpoint (a copy on the drafter's device, so a
tensor-parallel target needs nothing from its ranks). A `layers.0.input_layernorm.weight`
is ignored, as EAGLE-1 does. The public checkpoints ship `pytorch_model.bin`: convert it to
safetensors (safetensors.torch.save_file) first.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ...model.attention import AttentionMetadata, PagedAttentionBackend
from ...model.config import ModelArch, load_model_arch
from ...model.embedding import ParallelLMHead, VocabParallelEmbedding
from ...model.linear import ColumnParallelLinear, process_weights_after_loading
from ...model.llama import LlamaDecoderLayer, LlamaForCausalLM
from ...model.loader import checkpoint_files, iter_checkpoint, load_tensor, missing_tensors
from ...model.parallel import TPGroup
from ...model.rotary import RotaryEmbedding

_IGNORED = ("layers.0.input_layernorm.weight",)


class EagleDrafter(nn.Module):
    stacked_params = LlamaForCausalLM.stacked_params  # q/k/v and gate/up merge as in the target

    def __init__(
        self, arch: ModelArch, fc_bias: bool, dtype: torch.dtype, device: torch.device, kernel_impl: str
    ) -> None:
        super().__init__()
        tp = TPGroup()
        self.arch = arch
        self.dtype = dtype
        hidden = arch.hidden_size
        rotary = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling, device, kernel_impl
        )
        backend = PagedAttentionBackend(kernel_impl)
        self.fc = ColumnParallelLinear(2 * hidden, [hidden], fc_bias, tp, dtype, device)
        self.layers = nn.ModuleList([LlamaDecoderLayer(arch, rotary, backend, tp, dtype, device, kernel_impl)])
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE-1's first layer has none
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, hidden, tp, dtype, device)
        self.lm_head = ParallelLMHead(arch.vocab_size, hidden, tp, dtype, device)

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        for source, (target, shard_id) in self.stacked_params.items():
            if f".{source}." in name:
                return name.replace(f".{source}.", f".{target}."), shard_id
        return name, None

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """[N, H] g at each input token (the drafter's stand-in for the target's next h)."""
        x = self.fc(torch.cat([self.embed_tokens(input_ids), features.to(self.dtype)], dim=-1))
        hidden, residual = self.layers[0](positions, x, None, kv_cache, metadata)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden).float()


def load_eagle_drafter(
    folder: str, target_dir: str, target: ModelArch, dtype: torch.dtype, device: torch.device, kernel_impl: str
) -> EagleDrafter:
    """The drafter of `folder`, checked against the target; a ValueError naming
    speculative.heads where it does not fit."""
    path = Path(folder)
    try:
        arch = load_model_arch(path)
        files = checkpoint_files(path)
    except Exception as e:  # the loader's own error names the file
        raise ValueError(f"speculative.heads {folder}: {e}") from e
    if arch.num_layers != 1:
        raise ValueError(
            f"speculative.heads {folder}: an EAGLE-1 drafter has 1 layer, config.json says {arch.num_layers}"
        )
    for field in ("hidden_size", "vocab_size"):
        if getattr(arch, field) != getattr(target, field):
            raise ValueError(
                f"speculative.heads {folder} has {field} {getattr(arch, field)}, the target "
                f"{getattr(target, field)}: the drafter reads the target's hidden states and shares its vocabulary"
            )
    names = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            names.update(f.keys())
    drafter = EagleDrafter(arch, "fc.bias" in names, dtype, device, kernel_impl)
    params = dict(drafter.named_parameters())
    loaded = set()
    for name, tensor in iter_checkpoint(path):
        if name in _IGNORED or name.startswith("lm_head."):
            continue  # the LM head is the target's
        try:
            filled = load_tensor(drafter, params, name.removeprefix("model."), tensor)
        except Exception as e:
            raise ValueError(f"speculative.heads {folder}: {e}") from e
        loaded.add(filled)
    wanted = {"lm_head.weight"} | ({"embed_tokens.weight"} - loaded)
    _load_from_target(drafter, params, target_dir, target, wanted, loaded)
    missing = missing_tensors(drafter, params, loaded)
    if missing:
        raise ValueError(f"speculative.heads {folder}: the drafter lacks tensors {', '.join(missing[:6])}")
    process_weights_after_loading(drafter, kernel_impl)
    return drafter.eval()


def _load_from_target(
    drafter: EagleDrafter, params: dict, target_dir: str, target: ModelArch, wanted: set[str], loaded: set[str]
) -> None:
    """The target's embedding and LM head (its embedding again where the two are tied)."""
    sources = {"embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}
    if target.tie_word_embeddings:
        sources["lm_head.weight"] = "model.embed_tokens.weight"
    by_source: dict[str, list[str]] = {}
    for ours in wanted:
        by_source.setdefault(sources[ours], []).append(ours)
    for name, tensor in iter_checkpoint(target_dir):
        for ours in by_source.get(name, ()):
            loaded.add(load_tensor(drafter, params, ours, tensor))
