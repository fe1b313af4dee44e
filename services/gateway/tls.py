"""TLS (and mutual TLS) on both client APIs: `server.tls` and what reaches Serve's proxy.

Both APIs are served by Ray Serve's proxy actor (with `server.direct_ingress`, by the gateway
replica, which installs the same hook: launcher/direct_ingress.py), so TLS ends there:

    HTTP   Serve's own `HTTPOptions(ssl_certfile, ssl_keyfile, ssl_ca_certs)`, which it hands
           to uvicorn. Serve 2.60 does not pass uvicorn's `ssl_cert_reqs`, so a client CA alone
           loads the CA but asks no client for a certificate: the proxy hook makes it required.
    gRPC   Serve 2.60's gRPC proxy opens one insecure port on all interfaces
           (`default_impl.add_grpc_address`: `add_insecure_port("[::]:PORT")`) and has no TLS
           option. The proxy hook replaces that one function in the proxy's process: the same
           port, on `server.grpc_host`, with `grpc.ssl_server_credentials` when TLS is set.

The hook (`proxy_hook.setup_proxy`) runs in the proxy actor's constructor, before either server
starts, through Serve's `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`; its settings travel in the
environment (`proxy_environment`), which the proxy inherits from Ray's node (the local Ray that
`baton serve` starts, or the head pod's container in the chart).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

HOOK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
HOOK_PATH = "baton.services.gateway.proxy_hook.setup_proxy"
GRPC_HOST_ENV = "BATON_GRPC_HOST"
# Serve 2.60's switch for ingress replicas that run their own servers (launcher/direct_ingress.py).
DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
CERT_FILE_ENV = "BATON_TLS_CERT_FILE"
KEY_FILE_ENV = "BATON_TLS_KEY_FILE"
CLIENT_CA_FILE_ENV = "BATON_TLS_CLIENT_CA_FILE"


class TLSConfig(BaseModel):
    """The certificate both APIs present, and the CA whose client certificates they require."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cert_file: str | None = Field(None, description="PEM certificate (chain) the server presents; None: no TLS")
    key_file: str | None = Field(None, description="PEM private key of cert_file")
    client_ca_file: str | None = Field(
        None, description="PEM CA bundle: when set, every client must present a certificate it signed (mTLS)"
    )

    @model_validator(mode="after")
    def _together(self) -> TLSConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("server.tls.cert_file and server.tls.key_file must be given together")
        if self.client_ca_file is not None and self.cert_file is None:
            raise ValueError("server.tls.client_ca_file needs server.tls.cert_file and key_file (mTLS is TLS first)")
        return self

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None

    @property
    def requires_client_cert(self) -> bool:
        return self.client_ca_file is not None

    def describe(self) -> str:
        """One line for `baton serve`'s start-up summary."""
        if not self.enabled:
            return "off (plaintext HTTP and gRPC)"
        if self.requires_client_cert:
            return f"mTLS on HTTP and gRPC: certificate {self.cert_file}, client certificates signed by {self.client_ca_file}"
        return f"on HTTP and gRPC: certificate {self.cert_file}"

    def check_files(self) -> None:
        """Reads every configured file once, at start: a missing or unreadable one is a
        ValueError naming its field (not a proxy that fails later, in a log)."""
        for name in ("cert_file", "key_file", "client_ca_file"):
            path = getattr(self, name)
            if path is None:
                continue
            try:
                data = Path(path).read_bytes()
            except OSError as e:
                raise ValueError(f"server.tls.{name}: cannot read {path}: {e.strerror or e}") from e
            if b"-----BEGIN " not in data:
                raise ValueError(f"server.tls.{name}: {path} is not a PEM file")

    def http_options(self) -> dict[str, str]:
        """Serve's HTTPOptions fields for this config."""
        if not self.enabled:
            return {}
        options = {"ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file}
        if self.client_ca_file is not None:
            options["ssl_ca_certs"] = self.client_ca_file
        return options


def proxy_environment(tls: TLSConfig, grpc_host: str) -> dict[str, str]:
    """The environment that installs the proxy hook and tells it the gRPC bind address and TLS
    files (absolute paths: the proxy runs in another folder)."""
    env = {HOOK_ENV: HOOK_PATH, GRPC_HOST_ENV: grpc_host}
    for name, value in ((CERT_FILE_ENV, tls.cert_file), (KEY_FILE_ENV, tls.key_file)):
        if value is not None:
            env[name] = str(Path(value).resolve())
    if tls.client_ca_file is not None:
        env[CLIENT_CA_FILE_ENV] = str(Path(tls.client_ca_file).resolve())
    return env
