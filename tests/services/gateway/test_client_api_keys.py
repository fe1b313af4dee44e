"""The clients send an API key: the Python client and `baton generate`/`status` (--api-key, else
$BATON_API_KEY), and `baton bench` on both backends (the same, HTTP also $OPENAI_API_KEY), as
`authorization: Bearer <key>`. Against the gateway on an in-process gRPC server, without Ray."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from baton.services.cli import build_parser
from baton.services.client import BatonClient, call_metadata
from baton.services.gateway.api_keys import MISSING_KEY, ApiKeys
from baton.services.gateway.gateway import Gateway
from baton.services.loadtest.backends import make_backend
from baton.services.loadtest.cli import build_spec
from baton.services.loadtest.errors import BenchInputError
from baton.v1 import inference_pb2 as pb
from testlib.grpc_inprocess import serving

KEY = "sk-client-0f1e2d3c4b5a69788796"


@pytest.fixture
def keyed_gateway(fake_gateway, tokenizer_dir) -> Gateway:
    _, engine_client = fake_gateway()
    return Gateway(engine_client, tokenizer_dir, api_keys=ApiKeys([KEY]))


def test_call_metadata_takes_the_argument_else_the_environment(monkeypatch):
    monkeypatch.delenv("BATON_API_KEY", raising=False)
    assert call_metadata("baton") == (("application", "baton"),)
    assert call_metadata("app", KEY) == (("application", "app"), ("authorization", f"Bearer {KEY}"))
    monkeypatch.setenv("BATON_API_KEY", "sk-from-env")
    assert call_metadata("baton")[1] == ("authorization", "Bearer sk-from-env")
    assert call_metadata("baton", KEY)[1] == ("authorization", f"Bearer {KEY}")


async def test_the_python_client_is_served_with_its_key_and_refused_without(keyed_gateway, monkeypatch):
    monkeypatch.delenv("BATON_API_KEY", raising=False)
    async with serving(keyed_gateway) as address:

        def calls():
            with_key = BatonClient(address, api_key=KEY)
            without = BatonClient(address)
            try:
                request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(max_tokens=2))
                text = "".join(r.text for r in with_key.generate(request, timeout=10))
                model = with_key.model_info().model
                with pytest.raises(grpc.RpcError) as info:
                    without.model_info()
                return text, model, info.value.code(), info.value.details(), with_key.abort("none")
            finally:
                with_key.close()
                without.close()

        text, model, code, details, found = await asyncio.to_thread(calls)
    assert (text, model, code, details, found) == ("ok", "tiny", grpc.StatusCode.UNAUTHENTICATED, MISSING_KEY, False)


@pytest.mark.parametrize("command", ["generate", "status"])
def test_generate_and_status_take_an_api_key(command):
    argv = [command, "hello"] if command == "generate" else [command]
    assert build_parser().parse_args([*argv, "--api-key", KEY]).api_key == KEY
    assert build_parser().parse_args(argv).api_key is None  # then BatonClient reads $BATON_API_KEY


@pytest.mark.parametrize(
    ("backend", "flag", "environ", "expected"),
    [
        ("grpc", KEY, {"BATON_API_KEY": "sk-env"}, KEY),
        ("grpc", None, {"BATON_API_KEY": "sk-env", "OPENAI_API_KEY": "sk-openai"}, "sk-env"),
        ("grpc", None, {"OPENAI_API_KEY": "sk-openai"}, None),  # an OpenAI key is not sent to Baton's gRPC
        ("openai", None, {"BATON_API_KEY": "sk-env", "OPENAI_API_KEY": "sk-openai"}, "sk-env"),
        ("openai", None, {"OPENAI_API_KEY": "sk-openai"}, "sk-openai"),
    ],
)
def test_bench_takes_a_key_from_the_flag_or_the_environment(monkeypatch, backend, flag, environ, expected):
    for name in ("BATON_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    argv = ["bench", "run", "--backend", backend] + (["--api-key", flag] if flag else [])
    spec = build_spec(build_parser().parse_args(argv))
    assert spec.api_key == expected
    assert "api_key" not in spec.config() and (expected is None or expected not in str(spec.config()))


async def test_the_grpc_bench_backend_sends_its_key(keyed_gateway):
    async with serving(keyed_gateway) as address:
        backend = make_backend("grpc", address, api_key=KEY, endpoint="completions")
        keyless = make_backend("grpc", address, api_key=None)
        try:
            assert (await backend.probe(None)).model == "tiny"
            with pytest.raises(BenchInputError, match=r"refused the call: .*\(--api-key or \$BATON_API_KEY\)"):
                await keyless.probe(None)
        finally:
            await backend.close()
            await keyless.close()
