"""What decides each step: requests and their groups (n > 1, beam search), the scheduler
(continuous batching, chunked prefill, preemption), the paged KV cache (block pool,
prefix-cache manager, block hashes, KV events) and the scheduler's side of the handover."""
