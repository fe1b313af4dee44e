"""What the kernel tests sweep beyond their main grids: dtypes (with pytest ids) and the
attention kernels' extra shapes."""

from __future__ import annotations

import torch

ATTENTION_DTYPES = [torch.float32, torch.bfloat16]
ATTENTION_DTYPE_IDS = ["fp32", "bf16"]
ALL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ALL_DTYPE_IDS = ["fp32", "bf16", "fp16"]

# (head_dim, GQA group, KV heads, block size): the tiny test models' head_dim, MQA, head_dim
# 256, and block sizes from 1 to 256 (past a kernel's key tile, a tile no longer spans blocks).
OTHER_ATTENTION_SHAPES = [
    (16, 2, 2, 16),
    (32, 8, 1, 8),
    (256, 2, 2, 16),
    (64, 4, 2, 1),
    (64, 4, 2, 64),
    (64, 4, 2, 128),
    (128, 16, 1, 256),
]
OTHER_ATTENTION_SHAPE_IDS = [f"d{d}-gqa{g}-kv{h}-block{b}" for d, g, h, b in OTHER_ATTENTION_SHAPES]
