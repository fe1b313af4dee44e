"""Helpers for tests that call a running Baton."""

from __future__ import annotations

from baton.services.client import BatonClient
from baton.v1 import inference_pb2 as pb


def greedy_request(prompt: str, max_tokens: int = 16, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text=prompt, sampling=pb.SamplingParameters(max_tokens=max_tokens, temperature=0, ignore_eos=True, **sampling)
    )


def collect(client: BatonClient, request: pb.GenerateRequest, timeout: float = 60) -> list[pb.GenerateResponse]:
    return list(client.generate(request, timeout=timeout))


def worker_stats(app_name: str = "baton", role: str = "colocated"):
    """Block accounting of the (single) worker replica, checked on its engine thread."""
    from ray import serve

    return serve.get_deployment_handle(role, app_name=app_name).check_integrity.remote().result()
