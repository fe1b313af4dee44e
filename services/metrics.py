"""Prometheus metrics of the services, through Ray's metrics API.

Ray exports every process's metrics on each node's metrics port, with a `ray_` prefix
(`ray_baton_time_to_first_token_seconds`, ...), which is what KubeRay's Prometheus
integration scrapes; `baton serve` prints the local address. The Grafana dashboard is
docs/grafana/baton-dashboard.json. Names (before the prefix) and meanings:

  gateway  baton_time_to_first_token_seconds        histogram  arrival at the gateway -> first token
           baton_time_per_output_token_seconds      histogram  (e2e - ttft) / (output tokens - 1)
           baton_e2e_request_latency_seconds        histogram
           baton_requests_total{finish_reason,api}  counter    finished requests: the engine's finish reason (stop,
                                                    length, abort), `cancelled` for a request the client cancelled
                                                    or whose deadline passed (Serve's proxy cancels it either way,
                                                    so the two are one value), `error:<gRPC code>` for the others
           baton_requests_shed_total{api,reason}    counter    requests refused to keep admitted ones within bounds
                                                    (429 / 503 with Retry-After), recorded by the gateway (it knows
                                                    the api); reason: the refusing error's `reason`
                                                    (serving_errors), e.g. waiting_requests, waiting_tokens,
                                                    queue_delay, overloaded (unnamed), queue (Serve's handle
                                                    queue), no_replica
           baton_request_migrations_total{role,outcome}  counter  a request moved off a replica that died, by
                                                    the role it left; outcome: migrated (continues elsewhere with the
                                                    tokens it had), retried (lost before its first token: sent again),
                                                    failed (its migration limit was reached), refused (it cannot
                                                    migrate: n > 1 or beam search after tokens were streamed)
           baton_gateway_requests_in_flight         gauge      generation requests held by a gateway replica (bound:
                                                    server.limits.max_inflight_requests; over it: shed,
                                                    reason gateway_inflight)
           baton_prompt_tokens_total, baton_generation_tokens_total, baton_cached_prompt_tokens_total
           baton_kv_path_total{path}                counter    disaggregated requests by how the KV got there
  router   baton_router_decisions_total{role,reason} counter   prefix | load | imbalance | fallback | no_workers
           baton_replicas_fenced_total{role}        counter    replicas taken out of placement by a gateway's
                                                    request router (heartbeat lapsed; actor gone), by role
  worker   baton_num_requests_running / _waiting{role}, baton_kv_cache_usage_ratio{role},
           baton_num_waiting_prompt_tokens{role} (prompt tokens waiting for prefill: admission's token bound),
           baton_num_admission_queued{role} (admitted requests without a first output yet: admission's queue;
           set when the worker's metrics loop passes Admission.num_queued to EngineMetrics.export),
           baton_num_free_kv_blocks{role}, baton_num_warm_free_kv_blocks{role} (free, holding a prefix used within
           cache.warm_window_s), baton_prefix_cache_queries_total / _hits_total{role},
           baton_kv_transfer_bytes_total, baton_kv_transfer_seconds_total, baton_kv_transfer_failures_total,
           baton_kv_leases_expired_total, baton_kv_version_mismatches_total{role} (handed-over K/V of
           other weights, recomputed), baton_kv_dtype_mismatches_total{role} (handed over from a prefill
           side whose cache.kv_cache_dtype differs, recomputed), baton_step_seconds{role},
           baton_model_flops_utilization{role}, baton_memory_bandwidth_utilization{role},
           baton_spec_decode_num_drafts_total, _num_draft_tokens_total, _num_accepted_tokens_total{role}
           (speculative decoding: verification passes, drafts verified, drafts accepted; acceptance rate =
           accepted / draft tokens), baton_spec_decode_num_accepted_tokens_per_pos_total{role,position}
  autoscaler (Serve controller, services/autoscaling/policy.py, only for roles with Baton's policy)
           baton_autoscaling_desired_replicas{role}   gauge  what the policy asks for (before Serve's delays)
           baton_autoscaling_current_replicas{role}   gauge  running replicas it saw
           baton_autoscaling_signal{role,signal}      gauge  the value of the signal behind the decision
                                                    (signal: a services/autoscaling/signals.py key, e.g.
                                                    baton_waiting_prompt_tokens, baton_kv_usage, baton_tpot_s)

Everything here is created lazily in the process that records it (Ray's metric objects
live per process).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cache
from typing import Any

_LATENCY_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
_TOKEN_LATENCY_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]


@cache
def _metrics() -> dict[str, Any]:
    from ray.util.metrics import Counter, Gauge, Histogram

    role = ("role",)
    return {
        "ttft": Histogram("baton_time_to_first_token_seconds", "Time to first token", _LATENCY_S),
        "tpot": Histogram(
            "baton_time_per_output_token_seconds", "Time per output token after the first", _TOKEN_LATENCY_S
        ),
        "e2e": Histogram("baton_e2e_request_latency_seconds", "Request latency", _LATENCY_S),
        "requests": Counter("baton_requests_total", "Finished requests", ("finish_reason", "api")),
        "prompt_tokens": Counter("baton_prompt_tokens_total", "Prompt tokens"),
        "generation_tokens": Counter("baton_generation_tokens_total", "Generated tokens"),
        "cached_tokens": Counter("baton_cached_prompt_tokens_total", "Prompt tokens served from prefix caches"),
        "kv_path": Counter("baton_kv_path_total", "Requests by how their KV cache got to decode", ("path",)),
        "decisions": Counter("baton_router_decisions_total", "Routing decisions", ("role", "reason")),
        "shed": Counter(
            "baton_requests_shed_total", "Requests refused to keep admitted ones in bounds", ("api", "reason")
        ),
        "migrations": Counter(
            "baton_request_migrations_total", "Requests moved off a replica that died or drained", ("role", "outcome")
        ),
        "fenced": Counter("baton_replicas_fenced_total", "Replicas taken out of placement", role),
        "gateway_inflight": Gauge("baton_gateway_requests_in_flight", "Generation requests held by a gateway replica"),
        "waiting_prompt_tokens": Gauge(
            "baton_num_waiting_prompt_tokens", "Prompt tokens waiting for prefill in the engine", role
        ),
        "admission_queued": Gauge(
            "baton_num_admission_queued", "Admitted requests that have not produced a first output", role
        ),
        "running": Gauge("baton_num_requests_running", "Requests running in the engine", role),
        "waiting": Gauge("baton_num_requests_waiting", "Requests waiting in the engine", role),
        "kv_usage": Gauge("baton_kv_cache_usage_ratio", "Share of KV-cache blocks in use", role),
        "free_blocks": Gauge("baton_num_free_kv_blocks", "Free KV-cache blocks", role),
        "warm_blocks": Gauge(
            "baton_num_warm_free_kv_blocks", "Free KV-cache blocks holding a prefix used within the warm window", role
        ),
        "prefix_queries": Counter("baton_prefix_cache_queries_total", "Prompt tokens looked up", role),
        "prefix_hits": Counter("baton_prefix_cache_hits_total", "Prompt tokens found in the prefix cache", role),
        "kv_bytes": Counter("baton_kv_transfer_bytes_total", "KV bytes received by decode workers", role),
        "kv_seconds": Counter("baton_kv_transfer_seconds_total", "Time spent receiving KV", role),
        "kv_failures": Counter("baton_kv_transfer_failures_total", "KV transfers that failed (recomputed)", role),
        "kv_transfers": Counter("baton_kv_transfers_total", "KV transfers received", role),
        "leases_expired": Counter("baton_kv_leases_expired_total", "Prefill leases nobody claimed", role),
        "kv_version_mismatches": Counter(
            "baton_kv_version_mismatches_total", "Handed-over K/V of other weights, recomputed", role
        ),
        "kv_dtype_mismatches": Counter(
            "baton_kv_dtype_mismatches_total", "Handed-over K/V from a cache of another dtype, recomputed", role
        ),
        "step_seconds": Gauge("baton_step_seconds", "Mean engine step time", role),
        "mfu": Gauge("baton_model_flops_utilization", "Model FLOPs utilisation over recent steps", role),
        "mbu": Gauge("baton_memory_bandwidth_utilization", "Memory-bandwidth utilisation over recent steps", role),
        "spec_drafts": Counter("baton_spec_decode_num_drafts_total", "Speculative verification passes", role),
        "spec_draft_tokens": Counter("baton_spec_decode_num_draft_tokens_total", "Draft tokens verified", role),
        "spec_accepted": Counter("baton_spec_decode_num_accepted_tokens_total", "Draft tokens accepted", role),
        "spec_per_position": Counter(
            "baton_spec_decode_num_accepted_tokens_per_pos_total",
            "Draft tokens accepted by position",
            ("role", "position"),
        ),
        "autoscaling_desired": Gauge("baton_autoscaling_desired_replicas", "Replicas the policy asks for", role),
        "autoscaling_current": Gauge("baton_autoscaling_current_replicas", "Running replicas", role),
        "autoscaling_signal": Gauge(
            "baton_autoscaling_signal", "The signal behind the autoscaling decision", ("role", "signal")
        ),
    }


def record_request(
    api: str,
    finish_reason: str,
    ttft_s: float | None,
    e2e_s: float,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    kv_path: str | None,
) -> None:
    m = _metrics()
    m["requests"].inc(1, {"finish_reason": finish_reason or "unknown", "api": api})
    m["e2e"].observe(e2e_s)
    if ttft_s is not None:
        m["ttft"].observe(ttft_s)
        if completion_tokens > 1:
            m["tpot"].observe((e2e_s - ttft_s) / (completion_tokens - 1))
    m["prompt_tokens"].inc(prompt_tokens)
    if completion_tokens:
        m["generation_tokens"].inc(completion_tokens)
    if cached_tokens:
        m["cached_tokens"].inc(cached_tokens)
    if kv_path and kv_path != "colocated":
        m["kv_path"].inc(1, {"path": kv_path})


CANCELLED = "cancelled"  # baton_requests_total's finish_reason for cancels and passed deadlines
MIGRATION_OUTCOMES = frozenset({"migrated", "retried", "failed", "refused"})


def record_error(api: str, code: str) -> None:
    _metrics()["requests"].inc(1, {"finish_reason": f"error:{code}", "api": api})


def record_cancelled(api: str) -> None:
    """A request the client cancelled or whose deadline passed: not an error."""
    _metrics()["requests"].inc(1, {"finish_reason": CANCELLED, "api": api})


def record_shed(api: str, reason: str) -> None:
    """A request refused by admission control (`reason`: which bound, see the header)."""
    _metrics()["shed"].inc(1, {"api": api, "reason": reason})


def record_migration(role: str, outcome: str) -> None:
    """A request that left a `role` replica mid-stream; `outcome` in MIGRATION_OUTCOMES."""
    if outcome not in MIGRATION_OUTCOMES:
        raise ValueError(f"migration outcome {outcome!r} is not one of {sorted(MIGRATION_OUTCOMES)}")
    _metrics()["migrations"].inc(1, {"role": role, "outcome": outcome})


def record_gateway_inflight(num_inflight: int) -> None:
    _metrics()["gateway_inflight"].set(num_inflight)


def record_fenced(role: str) -> None:
    """A `role` replica taken out of placement (heartbeat lapsed, or its actor gone)."""
    _metrics()["fenced"].inc(1, {"role": role})


def record_decision(role: str, reason: str) -> None:
    _metrics()["decisions"].inc(1, {"role": role, "reason": reason})


def record_autoscaling(role: str, desired: int, current: int, signal: str, value: float) -> None:
    """One autoscaling decision for `role` (services/autoscaling/policy.py)."""
    m = _metrics()
    m["autoscaling_desired"].set(desired, {"role": role})
    m["autoscaling_current"].set(current, {"role": role})
    m["autoscaling_signal"].set(value, {"role": role, "signal": signal})


@dataclass(slots=True)
class _Totals:
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_bytes_received: int = 0
    kv_recv_seconds: float = 0.0
    kv_recv_failed: int = 0
    kv_recv_ok: int = 0
    kv_leases_expired: int = 0
    kv_version_mismatches: int = 0
    kv_dtype_mismatches: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


_COUNTERS = {
    "prefix_cache_queries": "prefix_queries",
    "prefix_cache_hits": "prefix_hits",
    "kv_bytes_received": "kv_bytes",
    "kv_recv_seconds": "kv_seconds",
    "kv_recv_failed": "kv_failures",
    "kv_recv_ok": "kv_transfers",
    "kv_leases_expired": "leases_expired",
    "kv_version_mismatches": "kv_version_mismatches",
    "kv_dtype_mismatches": "kv_dtype_mismatches",
    "spec_num_drafts": "spec_drafts",
    "spec_num_draft_tokens": "spec_draft_tokens",
    "spec_num_accepted_tokens": "spec_accepted",
}


class EngineMetrics:
    """Exports one engine's stats: gauges as they are, totals as counter increments."""

    def __init__(self, role: str) -> None:
        self.tags = {"role": role}
        self.last = _Totals()
        self.last_per_position: tuple[int, ...] = ()

    def export(self, stats, num_admission_queued: int | None = None) -> None:
        """`num_admission_queued`: the replica's Admission.num_queued (workers/admission.py)."""
        m = _metrics()
        m["running"].set(stats.num_running, self.tags)
        m["waiting"].set(stats.num_waiting, self.tags)
        m["waiting_prompt_tokens"].set(stats.num_waiting_prefill_tokens, self.tags)
        if num_admission_queued is not None:
            m["admission_queued"].set(num_admission_queued, self.tags)
        m["kv_usage"].set(stats.kv_cache_usage, self.tags)
        m["free_blocks"].set(stats.num_free_kv_blocks, self.tags)
        m["warm_blocks"].set(stats.num_warm_free_kv_blocks, self.tags)
        m["step_seconds"].set(stats.step_seconds, self.tags)
        m["mfu"].set(stats.model_flops_utilization, self.tags)
        m["mbu"].set(stats.memory_bandwidth_utilization, self.tags)
        for field in fields(_Totals):
            now, before = getattr(stats, field.name), getattr(self.last, field.name)
            if now > before:
                m[_COUNTERS[field.name]].inc(now - before, self.tags)
            setattr(self.last, field.name, now)
        before = self.last_per_position or (0,) * len(stats.spec_accepted_per_position)
        for position, (now, then) in enumerate(zip(stats.spec_accepted_per_position, before)):
            if now > then:
                m["spec_per_position"].inc(now - then, {**self.tags, "position": str(position)})
        self.last_per_position = stats.spec_accepted_per_position
