"""A small gRPC client for Baton: `baton generate` streams through it; `baton status` asks the
server for its model and health (gRPC) and reads its replicas and KV usage from Ray's metrics.
An API key (the argument, else $BATON_API_KEY) goes with every call as `authorization:
Bearer <key>` metadata. `ClientTLS` dials a server with `server.tls` set: the CA that signed its
certificate and, for mTLS, this client's certificate and key (the same options on HTTP)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
from baton.v1 import inference_pb2 as pb
from baton.v1 import inference_pb2_grpc as pb_grpc

from .client_tls import ClientTLS

API_KEY_ENV = "BATON_API_KEY"  # the key clients send when not given one


def call_metadata(application: str, api_key: str | None = None) -> tuple[tuple[str, str], ...]:
    """What every call sends: Serve's `application` routing key and, with a key (`api_key`,
    else $BATON_API_KEY), `authorization: Bearer <key>`."""
    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    metadata = (("application", application),)
    return metadata if api_key is None else (*metadata, ("authorization", f"Bearer {api_key}"))


def open_channel(address: str, tls: ClientTLS | None = None) -> grpc.Channel:
    """A plaintext channel, or a TLS one with `tls`."""
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.grpc_credentials())


class BatonClient:
    def __init__(
        self, address: str, application: str = "baton", api_key: str | None = None, tls: ClientTLS | None = None
    ) -> None:
        self.channel = open_channel(address, tls)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.metadata = call_metadata(application, api_key)

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None) -> Iterator[pb.GenerateResponse]:
        return self.stub.Generate(request, metadata=self.metadata, timeout=timeout)

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata)

    def abort(self, request_id: str) -> bool:
        """Whether a running request of this key had that id (an admin key: of any key)."""
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self.metadata).found

    def close(self) -> None:
        self.channel.close()


def generate_to_terminal(args: argparse.Namespace) -> int:
    sampling = pb.SamplingParameters(max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos)
    for name in ("temperature", "top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    try:
        client = BatonClient(args.address, args.application, args.api_key, ClientTLS.from_args(args))
    except ValueError as e:  # a TLS option: a file that cannot be read, a certificate without its key
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        for response in client.generate(pb.GenerateRequest(text=args.prompt, sampling=sampling), timeout=args.timeout):
            sys.stdout.write(response.text)
            sys.stdout.flush()
            if response.HasField("usage"):
                usage, timings = response.usage, response.timings
                print(
                    f"\n[{response.finish_reason}] prompt {usage.prompt_tokens} tokens "
                    f"({usage.cached_tokens} cached), {usage.completion_tokens} generated, "
                    f"TTFT {timings.time_to_first_token_s * 1000:.0f} ms",
                    file=sys.stderr,
                )
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


# -- baton status ------------------------------------------------------------------------------

# Ray exports every process's metrics with a `ray_` prefix (services/metrics.py).
_REPLICA_HEALTHY = "ray_serve_deployment_replica_healthy"
_TARGET_REPLICAS = "ray_serve_autoscaling_target_replicas"
_WORKER_GAUGES = {
    "ray_baton_kv_cache_usage_ratio": "kv_usage",
    "ray_baton_num_free_kv_blocks": "free_blocks",
    "ray_baton_num_requests_running": "running",
    "ray_baton_num_requests_waiting": "waiting",
}
_ROUTER_DECISIONS = "ray_baton_router_decisions"


@dataclass(slots=True)
class Replicas:
    """One Serve deployment's replicas, as Serve's controller reports them."""

    healthy: int = 0
    total: int = 0
    target: int | None = None  # what Serve scales to (None: not reported)


@dataclass(slots=True)
class WorkerLoad:
    """One engine worker's KV cache and queue, as it last reported them."""

    role: str
    worker_id: str  # Ray's worker id, shortened
    kv_usage: float = 0.0
    free_blocks: int = 0
    running: int = 0
    waiting: int = 0


@dataclass(slots=True)
class ServerMetrics:
    replicas: dict[str, Replicas] = field(default_factory=dict)  # by deployment name
    workers: list[WorkerLoad] = field(default_factory=list)
    num_router_decisions: int = 0  # placements made by Baton's prefix-aware router


def read_metrics(text: str, application: str) -> ServerMetrics:
    """The deployment's replicas and workers from the Prometheus text of Ray's exporter."""
    from prometheus_client.parser import text_string_to_metric_families

    metrics = ServerMetrics()
    workers: dict[str, WorkerLoad] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if family.name in (_REPLICA_HEALTHY, _TARGET_REPLICAS) and labels.get("application") != application:
                continue
            if family.name == _REPLICA_HEALTHY:
                replicas = metrics.replicas.setdefault(labels["deployment"], Replicas())
                replicas.total += 1
                replicas.healthy += int(sample.value == 1)
            elif family.name == _TARGET_REPLICAS:
                metrics.replicas.setdefault(labels["deployment"], Replicas()).target = int(sample.value)
            elif family.name in _WORKER_GAUGES and "role" in labels:
                key = labels.get("WorkerId", "")
                worker = workers.setdefault(key, WorkerLoad(role=labels["role"], worker_id=key[:8]))
                name = _WORKER_GAUGES[family.name]
                setattr(worker, name, sample.value if name == "kv_usage" else int(sample.value))
            elif family.name == _ROUTER_DECISIONS and sample.name.endswith("_total"):
                metrics.num_router_decisions += int(sample.value)
    metrics.workers = sorted(workers.values(), key=lambda w: (w.role, w.worker_id))
    return metrics


def print_status(
    address: str,
    application: str,
    metrics_url: str,
    timeout_s: float,
    api_key: str | None = None,
    tls: ClientTLS | None = None,
) -> int:
    """`baton status`: 1 when no Baton answers at `address`."""
    import urllib.request

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        client = BatonClient(address, application, api_key, tls)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        health = health_pb2_grpc.HealthStub(client.channel).Check(
            health_pb2.HealthCheckRequest(), metadata=client.metadata, timeout=timeout_s
        )
        info = client.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=client.metadata, timeout=timeout_s)
    except grpc.RpcError as e:
        print(f"no Baton at {address} (application {application}): {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    state = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
    print(f"Baton at {address} (application {application}): {state}")
    print(
        f"model     {info.model}: context {info.max_context_length} tokens, block size {info.block_size}, "
        f"tensor parallel {info.tensor_parallel_size}"
    )
    print(f"mode      {info.mode} (roles {', '.join(info.roles)})")
    print(f"router    {info.router or 'not reported (a server older than this client)'}")
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
            metrics = read_metrics(response.read().decode(), application)
    except OSError as e:
        print(f"replicas  unknown: no metrics at {metrics_url} ({e}; --metrics-address)")
        return 0
    _print_metrics(metrics, metrics_url)
    return 0


def _print_metrics(metrics: ServerMetrics, metrics_url: str) -> None:
    if metrics.num_router_decisions:
        print(f"          {metrics.num_router_decisions} prefix-aware placements so far")
    replicas = [
        f"{name} {r.healthy}/{r.total if r.target is None else r.target} healthy"
        for name, r in sorted(metrics.replicas.items())
    ]
    print(f"replicas  {', '.join(replicas) or 'none reported yet'}   ({metrics_url})")
    if not metrics.workers:
        print("KV cache  no worker has reported yet (every 2 s)")
    for i, worker in enumerate(metrics.workers):
        print(
            f"{'KV cache' if i == 0 else '':<9} {worker.role:<9} worker {worker.worker_id}: "
            f"{worker.kv_usage:.1%} used, {worker.free_blocks} blocks free, "
            f"{worker.running} running, {worker.waiting} waiting"
        )
