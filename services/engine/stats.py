"""What an engine reports about itself: a snapshot taken after each step (`EngineCore.stats`),
read by load reports to routers (services/router/worker_info.py), metrics and tests."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_waiting_prefill_tokens: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which were found
    num_warm_free_kv_blocks: int = 0  # free blocks whose cached prefix was used within cache.warm_window_s
    num_kv_leases: int = 0  # prefill side: prompts held for decode workers
    num_kv_receiving: int = 0  # decode side: prompts whose K/V is in flight
    kv_recv_ok: int = 0
    kv_recv_failed: int = 0  # each one recomputed locally
    kv_leases_expired: int = 0
    kv_version_mismatches: int = 0  # handed over from other weights: recomputed, never read
    kv_dtype_mismatches: int = 0  # handed over from a cache of another dtype: recomputed, never read
    kv_bytes_received: int = 0
    kv_recv_seconds: float = 0.0
    step_seconds: float = 0.0  # mean over the last steps
    model_flops_utilization: float = 0.0  # MFU over the last steps (0: device peak unknown)
    memory_bandwidth_utilization: float = 0.0  # MBU over the last steps
    # Speculative decoding, totals since start (spec_decode/speculator.py): verification
    # passes, drafts verified, drafts accepted, and accepted drafts by position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    num_draft_kv_blocks: int = 0  # the draft model's own KV blocks (method draft_model; 0: none)
    num_free_draft_kv_blocks: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens emitted per verification pass (accepted drafts + the one after them)."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0
