"""A throwaway certificate authority for TLS tests: a CA, a server certificate for loopback
(127.0.0.1, ::1, localhost) and a client certificate, as PEM files in a folder."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True, slots=True)
class ThrowawayPKI:
    ca_file: Path
    server_cert_file: Path
    server_key_file: Path
    client_cert_file: Path
    client_key_file: Path
    other_ca_file: Path  # a second CA, which signed nothing here


def make_pki(folder: Path) -> ThrowawayPKI:
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("baton test CA")
    _, other_ca = _ca("another CA")
    server_key, server_cert = _leaf(ca_key, ca_cert, "127.0.0.1", ExtendedKeyUsageOID.SERVER_AUTH, server=True)
    client_key, client_cert = _leaf(ca_key, ca_cert, "baton test client", ExtendedKeyUsageOID.CLIENT_AUTH)
    files = {
        "ca.pem": _pem(ca_cert),
        "other-ca.pem": _pem(other_ca),
        "server.pem": _pem(server_cert),
        "server.key": _key_pem(server_key),
        "client.pem": _pem(client_cert),
        "client.key": _key_pem(client_key),
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return ThrowawayPKI(*(folder / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")),
                   other_ca_file=folder / "other-ca.pem")  # fmt: skip


def _ca(name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        _builder(subject, subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # key_cert_sign, crl_sign
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(ca_key, ca_cert, name: str, usage, server: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (
        _builder(subject, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        names.append(x509.IPAddress(ipaddress.ip_address("::1")))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _builder(subject, issuer, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
