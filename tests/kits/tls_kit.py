"""A test CA and a server certificate for 127.0.0.1 (and localhost), made with `cryptography`: the TLS
of the kits' private servers (tests/kits/registry_kit.py's docker-registry, tests/kits/ldap_kit.py's
slapd). Valid from an hour ago for two days."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def certificates(folder: Path, *, ca_name: str, ca_file: str = "ca.pem", cert_file: str = "server.pem",
                 key_file: str = "server.key") -> Path:
    """The CA's certificate (`ca_file`), the server's (`cert_file`) and its key (`key_file`, mode 0600)
    written into `folder`; returns the CA's path."""
    now = datetime.datetime.now(datetime.UTC)
    valid = {"not_valid_before": now - datetime.timedelta(hours=1), "not_valid_after": now + datetime.timedelta(days=2)}
    ca_key = ec.generate_private_key(ec.SECP256R1())
    issuer = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca = (x509.CertificateBuilder().subject_name(issuer).issuer_name(issuer).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(valid["not_valid_before"]).not_valid_after(valid["not_valid_after"])
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    server = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
              .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(valid["not_valid_before"]).not_valid_after(valid["not_valid_after"])
              .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                          x509.DNSName("localhost")]), critical=False)
              .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
              .sign(ca_key, hashes.SHA256()))
    (folder / ca_file).write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / cert_file).write_bytes(server.public_bytes(serialization.Encoding.PEM))
    (folder / key_file).write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    (folder / key_file).chmod(0o600)
    return folder / ca_file
