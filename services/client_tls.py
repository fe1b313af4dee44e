"""TLS options of Baton's clients (`baton generate`, `baton status`, `baton bench`, the Python
client): the CA that signed the server's certificate and, for mTLS, this client's certificate
and key. Light to import: argparse builds its flags before any client is made."""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ClientTLS:
    """TLS towards a Baton server: its CA (None: the system's) and, for mTLS, a client certificate."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate needs its key: give --tls-cert and --tls-key together")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClientTLS | None:
        """From `--tls-ca`, `--tls-cert`, `--tls-key` (`add_tls_arguments`); None if none is given."""
        files = (args.tls_ca, args.tls_cert, args.tls_key)
        return None if all(f is None for f in files) else cls(*files)

    def grpc_credentials(self):
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "--tls-ca"),
            private_key=_read(self.key_file, "--tls-key"),
            certificate_chain=_read(self.cert_file, "--tls-cert"),
        )

    def ssl_context(self) -> ssl.SSLContext:
        """For HTTP clients (httpx's `verify=`, hence the openai client's `http_client`)."""
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file is not None:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


def add_tls_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--tls-ca", default=None, help="TLS: CA file that signed the server's certificate")
    parser.add_argument("--tls-cert", default=None, help="mTLS: this client's certificate (PEM)")
    parser.add_argument("--tls-key", default=None, help="mTLS: this client's private key (PEM)")


def _read(path: str | None, option: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{option}: cannot read {path}: {e.strerror or e}") from e
