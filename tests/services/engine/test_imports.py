"""The engine imports without Ray or Redis, and Baton's kernels never shadow Hugging Face's."""

from __future__ import annotations

import subprocess
import sys


def run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout


def test_engine_imports_without_ray_or_redis():
    out = run(
        "import sys; import baton.services.engine, baton.services.model.llama, baton.kernels.ops; "
        "print(sorted(m for m in ('ray', 'redis') if m in sys.modules))"
    )
    assert out.strip() == "[]"


def test_transformers_llama_loads_after_baton():
    out = run(
        "import baton.services.engine, baton.kernels.ops\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "m = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,"
        " num_attention_heads=2, vocab_size=64))\n"
        "print(type(m).__name__, is_kernels_available())"
    )
    assert out.strip() == "LlamaForCausalLM False"
