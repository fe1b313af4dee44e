"""Runs in Ray Serve's proxy actor, before its HTTP and gRPC servers start (Serve calls
`setup_proxy` from its constructor: `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, see tls.py).

    gRPC   `default_impl.add_grpc_address` is the one function Serve 2.60 calls to give its
           gRPC server an address (`[::]:PORT`, insecure). It becomes: the same port on
           BATON_GRPC_HOST, through `add_secure_port` with the certificate, key and (mTLS)
           client CA from the environment when they are set.
    HTTP   uvicorn's `create_ssl_context` in this process requires a client certificate when
           it is given a CA (Serve passes `ssl_ca_certs` but not `ssl_cert_reqs`).

Everything else about the proxy is Serve's. Both replacements check what they replace, so a
Serve whose internals moved fails at start, loudly, instead of serving plaintext.
"""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path

from . import tls

logger = logging.getLogger("ray.serve")


def setup_proxy() -> list:
    """Serve's callback: installs both replacements; adds no HTTP middleware."""
    _bind_grpc(
        host=os.environ.get(tls.GRPC_HOST_ENV, "0.0.0.0"),
        cert_file=os.environ.get(tls.CERT_FILE_ENV),
        key_file=os.environ.get(tls.KEY_FILE_ENV),
        client_ca_file=os.environ.get(tls.CLIENT_CA_FILE_ENV),
    )
    _require_http_client_certs()
    return []


def _bind_grpc(host: str, cert_file: str | None, key_file: str | None, client_ca_file: str | None) -> None:
    import grpc
    from ray.serve._private import default_impl

    if not callable(getattr(default_impl, "add_grpc_address", None)):
        raise RuntimeError("this Ray Serve has no default_impl.add_grpc_address: Baton cannot bind its gRPC port")
    credentials = None
    if cert_file is not None:
        credentials = grpc.ssl_server_credentials(
            [(_read(key_file, tls.KEY_FILE_ENV), _read(cert_file, tls.CERT_FILE_ENV))],
            root_certificates=_read(client_ca_file, tls.CLIENT_CA_FILE_ENV) if client_ca_file else None,
            require_client_auth=client_ca_file is not None,
        )

    def add_grpc_address(server, server_address: str) -> None:
        port = server_address.rsplit(":", 1)[1]
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
        if not bound:
            raise RuntimeError(f"the gRPC proxy could not bind {address}")
        logger.info(
            "gRPC proxy on %s (%s)",
            address,
            "plaintext" if credentials is None else "mTLS" if client_ca_file else "TLS",
        )

    default_impl.add_grpc_address = add_grpc_address


def _require_http_client_certs() -> None:
    import uvicorn.config

    create = uvicorn.config.create_ssl_context
    if getattr(create, "baton_requires_client_certs", False):
        return

    def create_ssl_context(*args, **kwargs) -> ssl.SSLContext:
        context = create(*args, **kwargs)
        if kwargs.get("ca_certs"):
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    create_ssl_context.baton_requires_client_certs = True
    uvicorn.config.create_ssl_context = create_ssl_context


def _read(path: str | None, env: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except (OSError, TypeError) as e:
        raise RuntimeError(f"{env}: cannot read {path}: {e}") from e
