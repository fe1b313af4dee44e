"""The KV-cache handover between prefill and decode workers (the baton).

types.py             what travels: KVTransferParams (prefill -> gateway -> decode), recv tasks, status
config.py            KVTransferConfig: transport, timeouts, lease, verify mode, fault injection
connector.py         the worker-side connector interface (one per TP rank)
torch_connector.py   torch.distributed transport: gloo on CPU, NCCL on CUDA
nixl_connector.py    RDMA through NIXL, when that library is installed
"""
