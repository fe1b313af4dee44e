"""A small gRPC client for Baton (what `baton generate` uses)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import grpc
from baton.v1 import inference_pb2 as pb
from baton.v1 import inference_pb2_grpc as pb_grpc


class BatonClient:
    def __init__(self, address: str, application: str = "baton") -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.metadata = (("application", application),)

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None) -> Iterator[pb.GenerateResponse]:
        return self.stub.Generate(request, metadata=self.metadata, timeout=timeout)

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()


def generate_to_terminal(args: argparse.Namespace) -> int:
    sampling = pb.SamplingParameters(max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos)
    for field in ("temperature", "top_p", "top_k", "seed"):
        value = getattr(args, field)
        if value is not None:
            setattr(sampling, field, value)
    client = BatonClient(args.address, args.application)
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
