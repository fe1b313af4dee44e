"""Writes a float checkpoint in compressed-tensors' pack-quantized W8A16 layout, as
llm-compressor saves it (services/model/compressed_tensors.py reads it)."""

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
        written[prefix + ".weight_packed"] = pack_int32(q)
        written[prefix + ".weight_scale"] = scale[:, None].to(tensor.dtype).contiguous()
        written[prefix + ".weight_shape"] = torch.tensor(tensor.shape)
        values[name] = q
    save_file(written, out_dir / "model.safetensors")
    config = json.loads((float_dir / "config.json").read_text())
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None}
    weights |= {"dynamic": False, "actorder": None, "observer": "minmax", "block_structure": None}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
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
