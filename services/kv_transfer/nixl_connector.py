"""RDMA transport through NVIDIA NIXL — not available in this build.

`transport: nixl` is accepted by the config so deployments can name it, but this build has
no NIXL data path: NIXL and an RDMA NIC were not available to build and test one against.
Choosing it fails at start-up with a message saying so (and what to use instead), rather
than silently falling back. The connector interface (connector.py) is what an
implementation fills in: register the KV caches as NIXL memory, advertise the agent's
metadata as the endpoint, and read leased blocks with one-sided RDMA reads.
"""

from __future__ import annotations

import importlib.util

import torch

from .config import KVTransferConfig


class NixlConnector:
    def __init__(self, config: KVTransferConfig, tp_rank: int, device: torch.device) -> None:
        installed = importlib.util.find_spec("nixl") is not None
        raise RuntimeError(
            "kv_transfer.transport 'nixl' is not available in this build of Baton"
            + ("" if installed else " (and the nixl package is not installed)")
            + "; use transport 'torch' (NCCL on GPUs, gloo on CPUs)"
        )
