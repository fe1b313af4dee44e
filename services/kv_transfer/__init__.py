"""The KV-cache handover between prefill and decode workers (the baton).

types.py             what travels: KVTransferParams (prefill -> gateway -> decode), recv tasks, status
config.py            KVTransferConfig: transport, timeouts, lease, verify mode, fault injection
connector.py         the worker-side connector interface (one per TP rank)
torch_connector.py   torch.distributed transport: gloo on CPU, NCCL on CUDA
nixl_connector.py    NVIDIA NIXL (UCX): the decode side reads leased blocks with one-sided READs
nixl_layout.py       its READ descriptors, checksum and message encoding
"""
