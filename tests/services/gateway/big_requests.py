"""Sends big requests to a running Baton from a process of its own (so that its work does not
compete for the measuring test's GIL), one after the other, and prints each outcome as a
JSON line: {"status": HTTP status or gRPC code name, "message": the error's text, "s": seconds}.

    python big_requests.py KIND ADDRESS COUNT     KIND: http, http-chunked, grpc-tokenize, grpc-generate,
                                                  or http-proxy, grpc-proxy

The `-proxy` kinds send the same 10 MB to a health check Ray Serve answers itself (HTTP
/-/healthz, gRPC RayServeAPIService/Healthz: Serve's proxy, or under direct ingress the gateway
replica's server, before Baton's handlers): what 10 MB costs this machine outside Baton's code,
the control the measurements are compared with.
"""

from __future__ import annotations

import json
import sys
import time

TEN_MB = 10 * 1024 * 1024


def http(address: str, chunked: bool, path: str = "/v1/completions") -> dict:
    import httpx

    body = b'{"model": "baton-tiny", "prompt": "' + b"z" * TEN_MB + b'"}'
    content = (body[i : i + 2**20] for i in range(0, len(body), 2**20)) if chunked else body
    reply = httpx.post(f"{address}{path}", content=content, headers={"content-type": "application/json"}, timeout=60)
    if reply.status_code == 200:
        return {"status": 200, "message": ""}
    return {"status": reply.status_code, "message": reply.json()["error"]["message"]}


def grpc_proxy(address: str) -> dict:
    import grpc

    data = b"\x0a" + varint(TEN_MB) + b"z" * TEN_MB  # field 1, a 10 MB string: an unknown field there
    identity = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    with grpc.insecure_channel(address) as channel:
        channel.unary_unary("/ray.serve.RayServeAPIService/Healthz", **identity)(data, timeout=60)
    return {"status": "OK", "message": ""}


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def grpc_call(address: str, rpc: str) -> dict:
    import grpc
    from baton.v1 import inference_pb2 as pb
    from baton.v1 import inference_pb2_grpc

    metadata = (("application", "baton"),)
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        try:
            if rpc == "tokenize":
                stub.Tokenize(pb.TokenizeRequest(text="z" * TEN_MB), metadata=metadata, timeout=60)
            else:
                list(stub.Generate(pb.GenerateRequest(text="z" * TEN_MB), metadata=metadata, timeout=60))
        except grpc.RpcError as error:
            return {"status": error.code().name, "message": error.details()}
    return {"status": "OK", "message": ""}


def main(kind: str, address: str, count: int) -> None:
    for _ in range(count):
        start = time.monotonic()
        if kind == "http-proxy":
            outcome = http(address, chunked=False, path="/-/healthz")
        elif kind == "grpc-proxy":
            outcome = grpc_proxy(address)
        elif kind.startswith("http"):
            outcome = http(address, chunked=kind == "http-chunked")
        else:
            outcome = grpc_call(address, kind.removeprefix("grpc-"))
        print(json.dumps({**outcome, "s": time.monotonic() - start}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
