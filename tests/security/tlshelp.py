"""Certificates for the TLS tests, made with the openssl command line: a throwaway CA, and certificates
it signs for the names a test dials (the test is skipped where openssl is missing)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def make_ca(folder: Path, name: str = "ca") -> Path:
    """A self-signed CA certificate `<name>.pem` (its key `<name>.key` beside it)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make certificates")
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN=kvpool test {name}",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=folder)
    return folder / f"{name}.pem"


def make_cert(ca: Path, name: str, san: str = "IP:127.0.0.1,DNS:localhost") -> tuple[Path, Path]:
    """A certificate for `san` (subjectAltName) signed by `ca`; (certificate, key) files beside it."""
    folder = ca.parent
    (folder / f"{name}.ext").write_text(f"subjectAltName={san}\nbasicConstraints=CA:FALSE\n"
                                        "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=folder)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", ca.name, "-CAkey", ca.with_suffix(".key").name,
             "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=folder)
    return folder / f"{name}.pem", folder / f"{name}.key"
