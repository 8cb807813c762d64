"""Adversarial checks of what an operator runs and sees: the `kvpool` command line (`up`, `worker`,
`status --watch`, `events`, `bench`), settings that reach a worker or client through `KVPOOL_*`
variables, the Prometheus endpoint as the Grafana dashboard reads it, and the Kubernetes deploy files.
Each test names one bug: bad input gets a typed one-line error (never a traceback, a dead listener or a
silently empty run), secrets stay out of what is printed, and the shipped files do what the README says."""
from __future__ import annotations

import gc
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvpool.core import PoolClient
from kvpool.core.cli import main
from kvpool.core.config import CacheConfig, WorkerConfig, load
from kvpool.core.errors import ConfigError, KVPoolError
from kvpool.core.nats_server import NatsServer, free_port
from kvpool.core.server import Worker

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "dashboards" / "kvpool.json"
K8S = REPO / "deploy" / "kubernetes"
KVPOOL = [sys.executable, "-m", "kvpool.core.cli"]
SECRET = "hunter2-not-for-screens"


@pytest.fixture(autouse=True)
def _own_state_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every worker, client and command of a test keeps its state (sockets, NATS credentials) in the test's
    own folder, never in the user's ~/.local/state/kvpool."""
    monkeypatch.setenv("KVPOOL_STATE_DIR", str(tmp_path / "state"))


@pytest.fixture
def worker() -> Iterator[Worker]:
    """An in-process worker on free ports (TCP, metrics), small and not prefaulted; stopped at the end."""
    w = Worker(WorkerConfig(port=0, metrics_port=0),
               CacheConfig(dram_bytes=32 << 20, dram_slab_size=1 << 20, prefault=False)).start()
    yield w
    w.stop()


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


def _run(argv: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(argv)} did not exit within {timeout} s:\n{err[-2000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _first_line_with(proc: subprocess.Popen[str], stream: str, needle: str, timeout: float) -> str | None:
    """The first line of the child's `stream` (stdout/stderr) containing `needle`, read for up to `timeout`
    seconds; None if the child exits or the time runs out first."""
    pipe = getattr(proc, stream)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([pipe], [], [], 0.2)
        if ready:
            line = pipe.readline()
            if line == "" and proc.poll() is not None:
                return None
            if needle in line:
                return str(line)
        elif proc.poll() is not None:
            return None
    return None


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


# ----- the metrics endpoint as the dashboard reads it -----------------------------------------------------

def test_the_dashboards_rates_are_taken_of_counters_not_gauges(worker: Worker) -> None:
    """An operator's Grafana panels (hit rate per tier, evictions and tier moves, checksum failures) take
    `rate()` of `kvpool_cache_*` series; a worker exports those cumulative counters as `gauge` without a
    `_total` suffix, so Prometheus flags every such query ("metric might not be a counter") and the
    endpoint's own metadata says they may go up and down. A series the dashboard rates must be a counter."""
    with PoolClient(mode="local", worker=worker.unix_path) as pool:
        pool.put("k", b"v" * 4096)
        pool.get("k"), pool.get("absent")
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            types[sample.name] = family.type
        types.setdefault(family.name, family.type)
        if family.type == "counter":
            types.setdefault(family.name + "_total", "counter")  # (declared before its first sample)
    dash = json.loads(DASHBOARD.read_text())
    rated = {name for p in dash["panels"] for t in p["targets"]
             for name in re.findall(r"\brate\((kvpool_[a-z_]+)\b", t["expr"])}
    assert rated, "the dashboard takes no rate() at all"
    not_counters = sorted(f"{n} ({types.get(n)})" for n in rated
                          if types.get(n) not in ("counter", "histogram"))
    assert not not_counters, f"the dashboard takes rate() of series the worker exports as gauges: {not_counters}"


# ----- secrets out of what is printed ---------------------------------------------------------------------

def test_status_watch_does_not_print_the_nats_password(nats: NatsServer, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvpool status --watch` against a NATS URL with a password (`nats://user:password@host`, as the README
    allows; the deploy files' `nats://TOKEN@host` likewise) draws the URL, password and all, in the header of
    every table: on screens, in screenshots and in terminal recordings. `kvpool status` without --watch, and
    every error, show it as `user:***@`."""
    port = nats.url.rsplit(":", 1)[1]
    url = f"nats://kvpool:{SECRET}@127.0.0.1:{port}"  # (a NATS without users accepts any credentials)
    assert main(["status", "--watch", "--count", "1", "--interval", "0.1", "--nats-url", url]) == 0
    out = capsys.readouterr().out
    assert "kvpool status" in out  # the table was drawn
    assert SECRET not in out, f"the watch table shows the NATS password:\n{out.splitlines()[0]}"


def test_the_events_bridge_does_not_log_the_nats_password(nats: NatsServer, tmp_path: Path) -> None:
    """`kvpool events --nats-url nats://user:password@... --zmq ...` (the router bridge, typically run as a
    service whose stderr goes to the journal) announces itself with the NATS URL as given: the password lands
    in the log. The command line itself hides it (moved to the environment), so the log is the only leak."""
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    port = nats.url.rsplit(":", 1)[1]
    url = f"nats://kvpool:{SECRET}@127.0.0.1:{port}"
    proc = subprocess.Popen([*KVPOOL, "events", "--nats-url", url, "--zmq", f"tcp://127.0.0.1:{free_port()}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        line = _first_line_with(proc, "stderr", "vLLM KV events on", timeout=30)
        assert line is not None, "the bridge did not start"
        assert SECRET not in line, f"the bridge logs the NATS password: {line.strip()}"
    finally:
        _stop(proc)


# ----- the command line: settings it takes ----------------------------------------------------------------

def test_kvpool_up_does_not_ignore_the_nats_url_it_is_given(tmp_path: Path) -> None:
    """`kvpool up --help` offers `--nats-url` ("register in the cluster at this NATS server"); given one,
    `kvpool up` silently starts a NATS of its own on --nats-port instead and registers its worker there,
    reporting "kvpool is up": the operator believes the worker joined the cluster at the URL. It must refuse
    the combination (or register at that URL, which is unreachable here: an error either way)."""
    unreachable = f"nats://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([*KVPOOL, "up", "--nats-url", unreachable, "--nats-port", str(free_port()), "--port", "0",
                             "--dram-bytes", "32MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        up = _first_line_with(proc, "stdout", "kvpool is up", timeout=45)
        assert up is None, f"--nats-url {unreachable} was ignored: {up.strip()}"
        assert proc.wait(timeout=10) == 2
    finally:
        _stop(proc)


@pytest.mark.parametrize("env, what", [
    ({"KVPOOL_DRAM_NAME": "team/a"}, "a shared-memory name with a '/' (the doc: 'without /')"),
    ({"KVPOOL_DEVICE": "tpu"}, "a device torch does not know"),
], ids=["dram_name", "device"])
def test_a_bad_cache_setting_is_a_one_line_config_error(tmp_path: Path, env: dict[str, str], what: str) -> None:
    """`kvpool worker` given a malformed setting (here through its KVPOOL_* variable) must say so in one line,
    `kvpool worker: ConfigError: ...`, exit status 2; it dies with a Python traceback of an OSError /
    RuntimeError from deep in the arena or torch instead."""
    ran = _run([*KVPOOL, "worker", "--port", "0", "--dram-bytes", "32MiB"], _env(**env))
    assert "Traceback" not in ran.stderr, f"{what}: a traceback instead of a one-line error:\n{ran.stderr[-1500:]}"
    assert ran.returncode == 2 and "ConfigError" in ran.stderr, (ran.returncode, ran.stderr[-1500:])


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (the dying accept thread,
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # and the socket it left open)
def test_a_negative_auth_timeout_does_not_kill_the_tcp_listener(monkeypatch: pytest.MonkeyPatch) -> None:
    """`KVPOOL_AUTH_TIMEOUT_S=-1` (a typo for 1, or "-1 = never" as other tools read it) is taken as it is:
    the worker starts and reports itself serving, then the first TCP connection raises ValueError in its
    accept thread, which dies: no TCP client is ever served again while the process looks healthy. It must
    be a ConfigError at start, or the worker must go on serving TCP."""
    monkeypatch.setenv("KVPOOL_AUTH_TIMEOUT_S", "-1")
    try:
        cfg = load(WorkerConfig, port=0)
        w = Worker(cfg, CacheConfig(dram_bytes=32 << 20, dram_slab_size=1 << 20, prefault=False)).start()
    except ConfigError:
        return  # refused at start: fine
    served = []
    try:
        for attempt in range(2):
            try:
                with PoolClient(mode="local", worker=w.address, timeout_s=2) as pool:
                    pool.put(f"k{attempt}", b"v")
                    served.append(pool.get(f"k{attempt}") == b"v")
            except KVPoolError:
                served.append(False)
    finally:
        w.stop()
        gc.collect()  # (the bug's leaked socket is reported here, not at the end of the session)
    assert served == [True, True], f"TCP clients served with auth_timeout_s=-1: {served}"


@pytest.mark.parametrize("value", ["-1", "nan"])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (the socket the failed call leaks)
def test_a_bad_client_timeout_is_a_config_error_not_a_value_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  value: str) -> None:
    """`KVPOOL_TIMEOUT_S=-1` (or nan) in an engine's environment is accepted by the client's config and then
    makes every call raise a bare `ValueError: Timeout value out of range` from the socket module, which
    the engine adapters (they catch KVPoolError) do not expect. It must be a ConfigError naming the setting."""
    monkeypatch.setenv("KVPOOL_TIMEOUT_S", value)
    raised: type[BaseException] | None = None
    try:
        with PoolClient(mode="local", worker=str(tmp_path / "no-worker.sock")) as pool:
            pool.get("k")
    except Exception as e:  # (kept as its type only: its traceback holds the socket the failed call leaks)
        raised, why = type(e), str(e)
    gc.collect()  # (that socket is reported here, not at the end of the session)
    assert raised is not None and issubclass(raised, ConfigError) and "timeout" in why, (raised, why)


# ----- kvpool bench: its options ---------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [["--ops", "-5"], ["--ops", "0"], ["--duration", "-1"], ["--duration", "nan"]],
                         ids=["ops-5", "ops0", "duration-1", "duration-nan"])
def test_bench_cache_refuses_a_run_of_nothing(capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    """`kvpool bench cache --ops -5` (or a negative or NaN duration) runs nothing and reports it as a
    success: exit status 0 and a table of zeros (`get_vs_memcpy 0.00x`), a figure that could be pasted
    into a report. `kvpool bench kvtest` refuses `--ops 0`; cache mode must refuse these too (exit 2)."""
    rc = main(["bench", "cache", "--quick", "--key-pool-size", "8", "--block-size", "4KiB", *flags])
    err = capsys.readouterr().err
    assert rc == 2, f"kvpool bench cache {' '.join(flags)}: exit status {rc}, a run of nothing reported as done"
    assert err.strip()


# ----- the Kubernetes deploy files ------------------------------------------------------------------------

def test_kubernetes_workers_keep_membership_in_every_nats_replica(tmp_path: Path) -> None:
    """deploy/kubernetes runs NATS as a 3-node cluster (nats-values.yaml) so that, as the README says,
    "three NATS nodes survive the loss of any one"; but the workers it deploys create the membership bucket
    with one replica (`nats_replicas` default 1: neither the ConfigMap nor the DaemonSet's env sets
    KVPOOL_NATS_REPLICAS=3, which the README names for this). Losing the one NATS node that holds the bucket
    loses every worker's membership: the whole pool is misses."""
    nats = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    replicas = nats["config"]["cluster"]["replicas"]
    docs = [d for d in yaml.safe_load_all((K8S / "kvpool-worker.yaml").read_text()) if d]
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    env = {e["name"]: e["value"] for e in daemonset["spec"]["template"]["spec"]["containers"][0]["env"]
           if "value" in e}
    path = tmp_path / "worker.toml"
    path.write_text(config_map["data"]["worker.toml"])
    cfg = load(WorkerConfig, file=path, section="worker", env=env)
    assert cfg.nats_replicas == replicas, (f"NATS runs {replicas} replicas but the workers keep membership in "
                                           f"{cfg.nats_replicas}")
