"""Machines made of network namespaces: each "host" is a namespace with one veth link to a bridge in a
"switch" namespace of its own, so nothing touches the real machine's network and no packet can leave.

Addresses come from one private subnet used only inside these namespaces. A host's link can be cut
(its switch port set down: packets vanish, as on a pulled cable) and one path can be black-holed (a
route in one host to one address through a neighbour that never answers: an asymmetric partition).
Every namespace, link and process is removed by `close()`, also after a failed test.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def can_build() -> str | None:
    """None if this process may create namespaces here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    probe = f"kvprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
    except OSError as e:
        return f"cannot create a network namespace: {e}"
    _ip("netns", "del", probe)
    return None


class Lab:
    """`n` hosts named h1..hn at 10.<subnet>.0.1..n/24, joined by one bridge."""

    def __init__(self, n: int, workdir: Path) -> None:
        tag = f"{os.getpid() % 10000}"
        self.switch = f"kvsw{tag}"
        self.prefix = f"kvh{tag}"
        self.subnet = 200 + os.getpid() % 50  # 10.200-249.0.0/24, inside the namespaces only
        self.workdir = workdir
        self.hosts = [f"h{i}" for i in range(1, n + 1)]
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._holes: list[tuple[str, str]] = []
        try:
            _ip("netns", "add", self.switch)
            _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
            _ip("link", "set", "br0", "up", ns=self.switch)
            _ip("link", "set", "lo", "up", ns=self.switch)
            for i, host in enumerate(self.hosts, 1):
                ns = self.ns(host)
                _ip("netns", "add", ns)
                _ip("link", "set", "lo", "up", ns=ns)
                _ip("link", "add", f"{self.prefix}e{i}", "type", "veth", "peer", "name", f"{self.prefix}p{i}")
                _ip("link", "set", f"{self.prefix}e{i}", "netns", ns, "name", "eth0")
                _ip("link", "set", f"{self.prefix}p{i}", "netns", self.switch, "name", f"port{i}")
                _ip("link", "set", f"port{i}", "master", "br0", "up", ns=self.switch)
                _ip("addr", "add", f"{self.addr(host)}/24", "dev", "eth0", ns=ns)
                _ip("link", "set", "eth0", "up", ns=ns)
        except BaseException:
            self.close()
            raise

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def addr(self, host: str) -> str:
        return f"10.{self.subnet}.0.{self.hosts.index(host) + 1}"

    def spawn(self, host: str, argv: Sequence[str], *, log: str, env: dict[str, str] | None = None,
              stdin: int | None = None, stdout: int | None = None) -> subprocess.Popen[bytes]:
        """Run `argv` on `host` (its namespace; the same file system and /dev/shm as everyone), in a
        session of its own. Its stderr, and its stdout unless `stdout` is given, go to `<workdir>/<log>`."""
        with open(self.workdir / log, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], stdin=stdin,
                                    stdout=out if stdout is None else stdout, stderr=out,
                                    env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs.append((host, proc))
        return proc

    def log(self, name: str, n: int = 4000) -> str:
        path = self.workdir / name
        return path.read_text(errors="replace")[-n:] if path.exists() else f"(no {name})"

    def cut(self, host: str) -> None:
        """Pull `host`'s cable: its switch port goes down, its packets and those sent to it vanish."""
        _ip("link", "set", f"port{self.hosts.index(host) + 1}", "down", ns=self.switch)

    def restore(self, host: str) -> None:
        _ip("link", "set", f"port{self.hosts.index(host) + 1}", "up", ns=self.switch)

    def blackhole(self, host: str, target: str) -> None:
        """From `host`, packets to `target` go to a neighbour that does not exist: they vanish, while
        every other path (and `target`'s own traffic) works: an asymmetric partition."""
        ghost = f"10.{self.subnet}.0.250"
        _ip("route", "add", f"{self.addr(target)}/32", "via", ghost, ns=self.ns(host))
        self._holes.append((host, target))

    def heal(self, host: str, target: str) -> None:
        _ip("route", "del", f"{self.addr(target)}/32", ns=self.ns(host))
        self._holes.remove((host, target))

    @staticmethod
    def stop(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def close(self) -> None:
        for _, proc in reversed(self.procs):
            try:
                self.stop(proc, timeout=5)
            except ProcessLookupError:
                pass
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", self.ns(host)], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and self.leftovers():
            time.sleep(0.1)

    def leftovers(self) -> list[str]:
        """Namespaces of this lab still present (none after `close`)."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [line.split()[0] for line in listed.splitlines()
                if line.startswith((self.switch, self.prefix))]
