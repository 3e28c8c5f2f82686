"""A throwaway PKI for the TLS tests: a CA and leaf certificates (server and client use)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Leaf:
    cert: str
    key: str


class CA:
    """A CA in ``directory``; ``leaf(name)`` issues a certificate for ``name``, localhost and 127.0.0.1."""

    def __init__(self, directory: str, name: str = "kvservice-test-ca") -> None:
        self.dir = directory
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(self._name)
            .issuer_name(self._name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert = os.path.join(directory, f"{name}.crt")
        with open(self.cert, "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))

    def leaf(self, name: str) -> Leaf:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        sans = [
            x509.DNSName(name),
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        out = Leaf(os.path.join(self.dir, f"{name}.crt"), os.path.join(self.dir, f"{name}.key"))
        with open(out.cert, "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))
        with open(out.key, "wb") as f:
            f.write(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
        os.chmod(out.key, 0o600)
        return out


def mtls_peer(ca: CA, name: str) -> dict[str, str]:
    """Server config overrides: KVPeer on a loopback TCP listener (no engine TCP port) over mutual
    TLS with a certificate ``name`` of ``ca`` (its identity as a peer)."""
    leaf = ca.leaf(name)
    return {
        "tcp_address": "",
        "peer_tcp_address": "127.0.0.1:0",
        "insecure": False,
        "peer_tls_cert": leaf.cert,
        "peer_tls_key": leaf.key,
        "peer_tls_ca": ca.cert,
    }
