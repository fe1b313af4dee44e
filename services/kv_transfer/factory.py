"""Picks the configured transport's connector for one rank."""

from __future__ import annotations

import torch

from .config import KVTransferConfig
from .connector import KVConnector


def create_connector(config: KVTransferConfig, tp_rank: int, device: torch.device) -> KVConnector:
    """The configured transport's connector for one rank."""
    # A transport's module loads only when it is configured.
    if config.transport == "nixl":
        from .nixl_connector import NixlConnector

        return NixlConnector(config, tp_rank, device)
    from .torch_connector import TorchDistributedConnector

    return TorchDistributedConnector(config, tp_rank, device)
