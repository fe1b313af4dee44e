"""What the engine needs to know about a model, read from its Hugging Face config.json.

Both config generations are understood: transformers 4 (`rope_theta`, `rope_scaling`,
`torch_dtype`) and 5 (`rope_parameters`, `dtype`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_MODEL_TYPE_TO_ARCH = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # {"rope_type": "llama3" | "linear", ...}; None: plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k before RoPE
    sliding_window: int | None
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def load_model_arch(model_dir: str | Path) -> ModelArch:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model folder {model_dir} does not exist")
    raw = _read_json(model_dir / "config.json", required=True)
    architecture = _architecture(raw, model_dir)
    model_type = SUPPORTED_ARCHITECTURES[architecture]
    num_heads = raw["num_attention_heads"]
    hidden = raw["hidden_size"]
    head_dim = raw.get("head_dim") or hidden // num_heads
    rope_theta, rope_scaling = _rope(raw, model_dir)
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{model_dir / 'config.json'}: hidden_act {act!r} is not supported (silu only)")
    sliding_window = raw.get("sliding_window")
    if model_type == "qwen2" or model_type == "qwen3":
        sliding_window = sliding_window if raw.get("use_sliding_window") else None
    generation = _read_json(model_dir / "generation_config.json", required=False) or {}
    eos = generation.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelArch(
        architecture=architecture,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        o_bias=model_type != "qwen2" and bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        sliding_window=sliding_window,
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        eos_token_ids=eos_ids,
        bos_token_id=raw.get("bos_token_id"),
    )


def _architecture(raw: dict[str, Any], model_dir: Path) -> str:
    names = raw.get("architectures") or []
    if not names and raw.get("model_type") in _MODEL_TYPE_TO_ARCH:
        names = [_MODEL_TYPE_TO_ARCH[raw["model_type"]]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise ModelLoadError(
        f"{model_dir / 'config.json'}: unsupported architecture {names or raw.get('model_type')!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(raw: dict[str, Any], model_dir: Path) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters")
    if params is None:  # transformers 4 layout
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params = dict(params)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{model_dir / 'config.json'}: rope type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.exists():
        if required:
            raise ModelLoadError(f"{path} is missing")
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
