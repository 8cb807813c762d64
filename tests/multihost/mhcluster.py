"""A cluster across hosts made of network namespaces: a 3-node NATS cluster (JetStream, 3 replicas) on
h1..h3, one worker on each, clients (tests/multihost/agent.py) on any host: on h4 remote to every
worker, on h1 shared memory with its own worker and TCP to the rest."""
from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvpool.core.nats_creds import Role, authorization, creds_path, ensure_creds
from kvpool.core.nats_server import binary, cluster_config

from netlab import Lab

TOKEN = "multihost-test-token"
NATS_HOSTS = ("h1", "h2", "h3")
WORKER_HOSTS = ("h1", "h2", "h3")
MEMBER_TTL_S = 10.0  # the default: a cut longer than this drops the worker from membership
CALL_TIMEOUT_S = 2.0
AGENT = str(Path(__file__).with_name("agent.py"))

class Agent:
    """One client process on a lab host (tests/multihost/agent.py), one JSON command at a time."""

    def __init__(self, lab: Lab, host: str, name: str, env: dict[str, str] | None = None, **opts: Any) -> None:
        self.lab, self.host, self.name = lab, host, name
        self.proc = lab.spawn(host, [sys.executable, AGENT, json.dumps(opts)], log=f"{name}.log", env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            ready = self._next(30)
            assert ready.get("ready"), f"agent {name} on {host} not ready: {ready} {lab.log(f'{name}.log')}"
        except BaseException:
            self.close()  # its pipes too: left to the garbage collector they fail whichever test runs then
            raise

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.decode())
        self._lines.put("")

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            log = self.lab.log(f"{self.name}.log")
            raise AssertionError(f"agent {self.name}: no reply in {timeout} s; log: {log}") from None
        if not line:
            raise AssertionError(f"agent {self.name} exited: {self.lab.log(f'{self.name}.log')}")
        return dict(json.loads(line))

    def __call__(self, op: str, timeout: float = 60.0, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()
        return self._next(timeout)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        Lab.stop(self.proc)
        self._reader.join(10)  # it ends at the dead process's end of output
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Cluster:
    def __init__(self, lab: Lab, workdir: Path) -> None:
        self.lab, self.workdir = lab, workdir
        self.nats_url = ",".join(f"nats://{lab.addr(h)}:4222" for h in NATS_HOSTS)
        self.nats: dict[str, subprocess.Popen[bytes]] = {}
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.agents: list[Agent] = []
        self.creds_dir = workdir / "nats-creds"  # NATS users per role, as `kvpool up` makes them
        self.authorization = authorization(ensure_creds(self.creds_dir))
        for h in NATS_HOSTS:
            self.start_nats(h)
        self._wait_for_jetstream()
        for h in WORKER_HOSTS:
            self.start_worker(h, wildcard=h == WORKER_HOSTS[-1])  # one binds 0.0.0.0 and advertises its address

    def start_nats(self, host: str) -> None:
        conf = self.workdir / f"nats-{host}.conf"
        conf.write_text(cluster_config(host, self.lab.addr(host), [self.lab.addr(h) for h in NATS_HOSTS],
                                       str(self.workdir / f"js-{host}"), authorization=self.authorization))
        self.nats[host] = self.lab.spawn(host, [binary(), "-c", str(conf)], log=f"nats-{host}.log")

    def _wait_for_jetstream(self, timeout: float = 30.0) -> None:
        """JetStream in a cluster serves once its meta group has a leader."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any("JetStream cluster new metadata leader" in self.lab.log(f"nats-{h}.log", 1 << 16)
                   or "Self is new JetStream cluster metadata leader" in self.lab.log(f"nats-{h}.log", 1 << 16)
                   for h in NATS_HOSTS):
                return
            time.sleep(0.2)
        raise AssertionError("NATS cluster elected no JetStream leader: "
                             + " | ".join(self.lab.log(f"nats-{h}.log", 1500) for h in NATS_HOSTS))

    def start_worker(self, host: str, *, wildcard: bool = False) -> None:
        addr = self.lab.addr(host)
        bind = ["--host", "0.0.0.0", "--advertise-host", addr] if wildcard else ["--host", addr]
        env = {"KVPOOL_STATE_DIR": str(self.workdir / f"state-{host}"), "KVPOOL_NATS_REPLICAS": "3",
               **self.creds_env("worker")}
        log = f"worker-{host}.log"
        self.workers[host] = self.lab.spawn(
            host, [sys.executable, "-m", "kvpool.core.cli", "worker", *bind, "--port", "7461", "--token", TOKEN,
                   "--nats-url", self.nats_url, "--worker-id", f"w-{host}", "--dram-bytes", "64MiB"],
            log=log, env=env)
        deadline = time.monotonic() + 30
        while "kvpool worker " not in self.lab.log(log, 1 << 16):
            assert self.workers[host].poll() is None, f"worker on {host} exited: {self.lab.log(log)}"
            assert time.monotonic() < deadline, f"worker on {host} not ready: {self.lab.log(log)}"
            time.sleep(0.1)

    def agent(self, host: str, replication: int = 1) -> Agent:
        a = Agent(self.lab, host, f"agent-{host}-r{replication}-{len(self.agents)}", self.creds_env("client"),
                  mode="cluster",
                  nats_url=self.nats_url, token=TOKEN, replication=replication, timeout_s=CALL_TIMEOUT_S,
                  expect=len(WORKER_HOSTS))
        self.agents.append(a)
        return a

    def creds_env(self, role: Role) -> dict[str, str]:
        """The environment that hands a process the NATS credentials of `role`."""
        return {"KVPOOL_NATS_CREDS": str(creds_path(role, self.creds_dir))}

    def close(self) -> None:
        for a in self.agents:
            a.close()
