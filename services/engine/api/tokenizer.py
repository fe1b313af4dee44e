"""Loads a model folder's tokenizer (Hugging Face fast tokenizer: tokenizer.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ModelLoadError


def load_tokenizer(path: str | Path) -> Any:
    path = Path(path)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise ModelLoadError(f"{path} has no tokenizer (tokenizer.json is missing)")
    from transformers import AutoTokenizer  # heavy import, deferred to first use

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types; name the folder in one place
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {e}") from e
