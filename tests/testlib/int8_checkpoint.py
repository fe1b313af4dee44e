"""Writes a float checkpoint in compressed-tensors' W8A16 (pack-quantized) or W8A8
(int-quantized, activations dynamic per token) layout, as llm-compressor saves them
(services/model/compressed_tensors.py reads them)."""

from __future__ import annotations

import json
import shutil

import torch
from baton.services.model.compressed_tensors import pack_int32
from baton.services.model.int8_linear import quantize_int8
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_w8a16(float_dir, out_dir, scheme: str = "minmax-127", ignore=("lm_head",)) -> dict[str, torch.Tensor]:
    """`float_dir` as llm-compressor's W8A16 output: pack-quantized int8 per channel. Returns
    the int8 values written, by weight name. scheme "minmax-127.5" divides by 127.5 as
    llm-compressor's min-max observer does (so -128 occurs)."""
    return _write(float_dir, out_dir, scheme, ignore, w8a8=False)


def write_w8a8(float_dir, out_dir, ignore=("lm_head",)) -> dict[str, torch.Tensor]:
    """`float_dir` as llm-compressor's W8A8 output: int-quantized int8 weights per channel,
    activations int8 dynamic per token. Returns the int8 values written, by weight name."""
    return _write(float_dir, out_dir, "minmax-127", ignore, w8a8=True)


def _write(float_dir, out_dir, scheme: str, ignore, w8a8: bool) -> dict[str, torch.Tensor]:
    shutil.copytree(float_dir, out_dir)
    tensors = load_file(float_dir / "model.safetensors")
    written, values = {}, {}
    for name, tensor in tensors.items():
        prefix = name.removesuffix(".weight")
        quantized = name.endswith(".weight") and (
            prefix.rsplit(".", 1)[-1] in LINEARS or (prefix == "lm_head" and "lm_head" not in ignore)
        )
        if not quantized:
            written[name] = tensor
            continue
        if scheme == "minmax-127":
            q, scale = quantize_int8(tensor)
        else:
            scale = tensor.abs().amax(dim=1) / 127.5
            q = torch.round(tensor / scale[:, None]).clamp(-128, 127).to(torch.int8)
        if w8a8:
            written[name] = q
        else:
            written[prefix + ".weight_packed"] = pack_int32(q)
            written[prefix + ".weight_shape"] = torch.tensor(tensor.shape)
        written[prefix + ".weight_scale"] = scale[:, None].to(tensor.dtype).contiguous()
        values[name] = q
    save_file(written, out_dir / "model.safetensors")
    config = json.loads((float_dir / "config.json").read_text())
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None}
    weights |= {"dynamic": False, "actorder": None, "observer": "minmax", "block_structure": None}
    activations = None
    if w8a8:
        activations = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
        activations |= {"group_size": None, "actorder": None, "observer": None, "block_structure": None}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if w8a8 else "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": activations,
                "output_activations": None,
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "quantization_status": "compressed",
    }
    (out_dir / "config.json").write_text(json.dumps(config))
    return values
