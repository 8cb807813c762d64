"""NATS users as nkeys (what `kvpool up` makes): seeds 0600 in the state folder, only public keys in the
server's config, a client signs the server's nonce (no secret on the wire); a seed the server does not
list is refused at once; password users (files of older versions, URLs with credentials) still work."""
from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.core import AuthError
from kvpool.core.cluster import Membership
from kvpool.core.errors import ConfigError
from kvpool.core.nats_creds import NatsCreds, authorization, creds_path, ensure_creds, load_creds, new_user_seed
from kvpool.core.nats_server import NatsServer


def _info() -> dict[str, object]:
    return {"tcp": "127.0.0.1:1", "node_id": "n"}


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVPOOL_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.fixture
def nkey_server(state: Path) -> Iterator[NatsServer]:
    server = NatsServer(state / "nats", port=0, authorization=authorization(ensure_creds())).start()
    yield server
    server.stop()


def test_nkey_users_sign_in_and_the_server_keeps_no_secret(nkey_server: NatsServer, state: Path) -> None:
    seeds = []
    for role in ("worker", "client", "admin"):
        path = creds_path(role)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        data = json.loads(path.read_text())
        assert set(data) == {"user", "nkey_seed"} and data["nkey_seed"].startswith("SU")
        seeds.append(data["nkey_seed"])
    conf = (nkey_server.store_dir / "nats-server.conf").read_text()
    assert not any(seed in conf for seed in seeds)  # the server lists public keys only
    assert all(load_creds(creds_path(r)).public_key in conf for r in ("worker", "client", "admin"))
    worker = Membership(nkey_server.url, role="worker")  # found in the state folder, as `kvpool up`'s processes do
    client = Membership(nkey_server.url)
    try:
        worker.register("w", _info, heartbeat_s=1)
        client.watch()
        assert client.wait_for(lambda m: "w" in m, 5)
        with pytest.raises(AuthError, match="may not register"):  # the client's nkey keeps the client's permissions
            client.register("fake", _info, heartbeat_s=1)
    finally:
        client.close()
        worker.close()
    with pytest.raises(AuthError, match="refused"):  # a seed the server does not list
        Membership(nkey_server.url, creds=NatsCreds("stranger", seed=new_user_seed()), connect_timeout_s=5)


def test_password_users_still_work(state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A password file made by an older version is kept beside new nkeys; URLs with credentials work."""
    folder = state / "nats"
    ensure_creds(folder, nkeys=False)
    (folder / "worker.json").unlink()  # the worker's is made anew, as an nkey
    creds = ensure_creds(folder)
    assert creds["client"].password and creds["client"].seed is None and creds["worker"].seed
    server = NatsServer(tmp_path / "srv", port=0, authorization=authorization(creds)).start()
    try:
        c = creds["client"]
        Membership(server.url.replace("nats://", f"nats://{c.user}:{c.password}@")).close()
        monkeypatch.setenv("KVPOOL_NATS_CREDS", str(creds_path("worker", folder)))
        Membership(server.url, role="worker").close()
    finally:
        server.stop()


def test_malformed_seed_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"user": "x", "nkey_seed": "SUnot-a-seed"}))
    bad.chmod(0o600)
    with pytest.raises(ConfigError, match=f"{bad}: .*seed"):
        load_creds(bad)


def test_a_credentials_file_others_can_read_or_a_link_is_refused(tmp_path: Path) -> None:
    ensure_creds(tmp_path / "creds")
    path = creds_path("client", tmp_path / "creds")
    assert load_creds(path).public_key
    link = tmp_path / "link.json"
    link.symlink_to(path)
    with pytest.raises(ConfigError, match="a link"):
        load_creds(link)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_creds(path)
    with pytest.raises(ConfigError, match="has a password, not an nkey"):
        NatsCreds("u", "p").public_key  # noqa: B018 - the property raises
