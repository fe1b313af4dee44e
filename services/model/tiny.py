"""Builds small random Llama/Qwen3 models with a real tokenizer, offline.

The tokenizer is a byte-level BPE trained with `tokenizers` on Python's own help texts
(`pydoc_data`), saved with `save_pretrained` together with a ChatML chat template. Weights
are random (initializer_range 0.1, so greedy output is not one repeated token). Nothing
is downloaded: this is what tests, benchmarks and `baton serve`'s default run on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # Tests: fast on two CPU cores.
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1024,
        max_position_embeddings=4096,
    ),
    # Benchmarks: about 30M parameters.
    "bench": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=8192,
        max_position_embeddings=4096,
    ),
}

ARCHES = ("llama", "qwen3", "qwen2", "mistral")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def training_texts() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_texts(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def make_tiny_model(
    path: str | Path, arch: str = "llama", preset: str = "tiny", seed: int = 0, **overrides: Any
) -> Path:
    """Writes a random model folder (config.json, model.safetensors, tokenizer) to `path`."""
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {', '.join(ARCHES)}, got {arch!r}")
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    settings = {**PRESETS[preset], **overrides}
    tokenizer = train_tokenizer(settings["vocab_size"])
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    common = dict(
        settings,
        vocab_size=len(tokenizer),
        initializer_range=0.1,
        rms_norm_eps=1e-6,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=eos_id,
    )
    config_class, model_class, tied = {
        "llama": (LlamaConfig, LlamaForCausalLM, False),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, True),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, True),  # q/k/v projections with bias
        "mistral": (MistralConfig, MistralForCausalLM, False),
    }[arch]
    config = config_class(**common, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None).save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "baton_tiny_model.json").write_text(
        json.dumps({"arch": arch, "preset": preset, "seed": seed, "overrides": overrides})
    )
    return path
