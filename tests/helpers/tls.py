"""Certificates for TLS tests, from a throwaway CA (trustme)."""

from __future__ import annotations

from pathlib import Path

import trustme


def write_pems(ca: trustme.CA, directory: Path) -> dict[str, Path]:
    """One certificate for 127.0.0.1 and localhost signed by ``ca``, written to ``directory``:
    {"ca", "cert" (the chain), "key"} -> PEM file."""
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {"ca": directory / "ca.pem", "cert": directory / "cert.pem", "key": directory / "key.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    paths["cert"].write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    return paths
