"""TLS for a worker's TCP connections (optional, Python's `ssl`): the worker serves with a certificate
and key (`WorkerConfig.tls_cert` / `tls_key`, `--tls-cert` / `--tls-key`); a client verifies that
certificate against the CA it is given (`ClientConfig.tls_ca`, `KVPOOL_TLS_CA`) and the address it
dials, then authenticates with the token's challenge-response inside the encrypted channel.

A client with a CA talks TLS to every TCP worker and refuses one that does not (it sends nothing in
clear); a client without one talks clear text. Unix sockets (same node) never use TLS.
"""
from __future__ import annotations

import functools
import os
import ssl

from .errors import ConfigError

__all__ = ["ca_file", "client_context", "server_context", "server_name"]


def ca_file(ca: str | None = None) -> str | None:
    """The CA file a client verifies workers against: `ca` if given, else `KVPOOL_TLS_CA`; None: no TLS."""
    return ca or os.environ.get("KVPOOL_TLS_CA") or None


@functools.lru_cache(maxsize=16)
def _client_context(ca: str) -> ssl.SSLContext:
    try:
        ctx = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"cannot load the TLS CA file {ca} (KVPOOL_TLS_CA, tls_ca): {e}") from e
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def client_context(ca: str | None = None) -> ssl.SSLContext | None:
    """A context that trusts only the CA in `ca_file(ca)` and checks the worker's name (the host of the
    address dialled: a DNS name or IP in the certificate's subjectAltName); None when no CA is set.
    One context per file, shared by the connections that use it (contexts are thread-safe)."""
    found = ca_file(ca)
    return _client_context(found) if found else None


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """A worker's context: TLS 1.2 or later with `cert` (PEM, the chain a client verifies) and `key`."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"cannot load the worker's TLS certificate {cert} with key {key}: {e}") from e
    return ctx


def server_name(host: str) -> str:
    """The name a client checks the certificate against: the address's host, IPv6 brackets removed."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host
