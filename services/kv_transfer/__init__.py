"""The KV-cache handover between prefill and decode workers (the baton).

types.py             what travels: KVTransferParams (prefill -> gateway -> decode), recv tasks, status
config.py            KVTransferConfig: role, transport, timeouts, lease, verify mode, fault injection
connector.py         the worker-side connector interface (one per TP rank), what transports share
factory.py           create_connector: the configured transport's connector
torch_connector.py   torch.distributed transport: gloo on CPU, NCCL on CUDA
wire_layout.py       its tensors on the wire, layer by layer (and the block runs NIXL reads)
nixl_connector.py    NVIDIA NIXL (UCX): the decode side reads leased blocks with one-sided READs
nixl_prefill.py      its prefill side: claims on leased blocks, granted or refused
nixl_agent.py        its agent and the notification mailbox
nixl_layout.py       its READ descriptors, checksum and message encoding
"""
