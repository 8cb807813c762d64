"""The deployment files, checked offline: Kubernetes manifests against the Kubernetes schema
(kubernetes-validate, strict), systemd units with systemd-analyze where it exists, nats.conf with
nats-server's own config test; and everything they hand to kvpool parses with kvpool's own CLI and
config loaders, so a renamed flag or setting breaks this test rather than a deployment."""
from __future__ import annotations

import configparser
import copy
import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvpool.core.cli import build_parser
from kvpool.core.client import ClientConfig
from kvpool.core.config import CacheConfig, WorkerConfig, load, read_file
from kvpool.core.nats_server import binary as nats_binary

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "kubernetes"
SYSTEMD = DEPLOY / "systemd"
K8S_VERSION = kubernetes_validate.latest_version()


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _all_manifests() -> list[dict[str, Any]]:
    return _docs("kvpool-worker.yaml") + _docs("kvpool-secrets.yaml")


def _daemonset() -> dict[str, Any]:
    return next(d for d in _all_manifests() if d["kind"] == "DaemonSet")


def _known_env() -> set[str]:
    names = {f.name for c in (WorkerConfig, CacheConfig, ClientConfig) for f in dataclasses.fields(c)}
    return {"KVPOOL_" + n.upper() for n in names} | {"KVPOOL_STATE_DIR", "KVPOOL_CONFIG"}


@pytest.mark.parametrize("doc", _all_manifests(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifests_match_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_schema_check_catches_mistakes() -> None:
    bad = copy.deepcopy(_daemonset())
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "seven"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    typo = copy.deepcopy(_daemonset())
    typo["spec"]["template"]["spec"]["hostNetwrok"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSION, strict=True)


def test_daemonset_hands_kvpool_what_it_understands(tmp_path: Path) -> None:
    pod = _daemonset()["spec"]["template"]["spec"]
    c = pod["containers"][0]
    args = build_parser().parse_args(c["args"])
    assert args.command == "worker" and args.events and args.metrics_port == 9464
    assert {e["name"] for e in c["env"]} <= _known_env()
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    host = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["volumes"]}
    assert host[mounts["/dev/shm"]] == "/dev/shm" and pod["hostNetwork"] is True
    config_map = next(d for d in _all_manifests() if d["kind"] == "ConfigMap")
    (tmp_path / "worker.toml").write_text(config_map["data"]["worker.toml"])
    _check_worker_toml(tmp_path / "worker.toml")
    worker = load(WorkerConfig, file=tmp_path / "worker.toml", section="worker", env={})
    assert worker.unix_path is not None and Path(worker.unix_path).parent.as_posix() in mounts
    cache = load(CacheConfig, file=tmp_path / "worker.toml", section="cache", env={})
    assert cache.ssd_path is not None and cache.ssd_path.startswith("/var/lib/kvpool")


def test_secret_references_resolve() -> None:
    secret = next(d for d in _all_manifests() if d["kind"] == "Secret")
    keys = set(secret["stringData"])
    refs = [e["valueFrom"]["secretKeyRef"] for e in _daemonset()["spec"]["template"]["spec"]["containers"][0]["env"]
            if "secretKeyRef" in e.get("valueFrom", {})]
    nats = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    refs += [v["valueFrom"]["secretKeyRef"] for v in nats["container"]["env"].values()]
    assert refs and all(r["name"] == secret["metadata"]["name"] and r["key"] in keys for r in refs)
    assert nats["config"]["jetstream"]["enabled"] is True
    assert "$NATS_TOKEN" in nats["config"]["merge"]["authorization"]["token"]
    assert "NATS_TOKEN" in nats["container"]["env"]


def _check_worker_toml(path: Path) -> None:
    data = read_file(path)
    assert set(data) == {"worker", "cache"}
    for section, cls in (("worker", WorkerConfig), ("cache", CacheConfig)):
        unknown = set(data[section]) - {f.name for f in dataclasses.fields(cls)}
        assert not unknown, f"{path.name} [{section}]: unknown settings {unknown}"
        load(cls, file=path, section=section, env={})  # every value converts


def _unit(name: str) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(SYSTEMD / name)
    return unit


def test_systemd_units_start_what_exists(tmp_path: Path) -> None:
    worker, nats = _unit("kvpool-worker.service"), _unit("kvpool-nats.service")
    for unit in (worker, nats):
        assert {"Unit", "Service", "Install"} <= set(unit.sections())
    cmd = shlex.split(worker["Service"]["ExecStart"])
    assert cmd[0].endswith("/kvpool")
    args = build_parser().parse_args(cmd[1:])
    assert args.command == "worker" and args.config == "/etc/kvpool/worker.toml"
    _check_worker_toml(SYSTEMD / "worker.toml")
    env = dict(line.split("=", 1) for line in (SYSTEMD / "worker.env").read_text().splitlines()
               if line and not line.startswith("#"))
    assert set(env) <= _known_env()
    assert shlex.split(nats["Service"]["ExecStart"])[0].endswith("/nats-server")
    # nats-server's own check of nats.conf, with the token its EnvironmentFile provides
    nats_env = dict(line.split("=", 1) for line in (SYSTEMD / "nats.env").read_text().splitlines()
                    if line and not line.startswith("#"))
    done = subprocess.run([nats_binary(), "-t", "-c", str(SYSTEMD / "nats.conf")], env={**os.environ, **nats_env},
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    if shutil.which("systemd-analyze"):  # systemd's own check, against this machine's binaries
        bindir = str(Path(sys.executable).parent)
        for name in ("kvpool-worker.service", "kvpool-nats.service"):
            (tmp_path / name).write_text((SYSTEMD / name).read_text().replace("/opt/kvpool/venv/bin", bindir))
        done = subprocess.run(["systemd-analyze", "verify", "--man=no", *(str(tmp_path / n) for n in
                               ("kvpool-worker.service", "kvpool-nats.service"))],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0 and not done.stderr.strip(), done.stderr
