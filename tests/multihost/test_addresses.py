"""What a worker advertises and who counts as the same node: no namespaces needed for these."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpool.core import ConfigError
from kvpool.core.config import WorkerConfig, default_node_id
from kvpool.core.server import Worker


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])
def test_a_wildcard_bind_in_a_cluster_needs_an_advertised_address(wildcard: str) -> None:
    with pytest.raises(ConfigError, match="advertise-host"):
        Worker(WorkerConfig(host=wildcard, token="t", nats_url="nats://127.0.0.1:1"))


def test_node_id_tells_network_namespaces_apart_though_the_hostname_is_shared() -> None:
    here = default_node_id()
    assert here.startswith(os.uname().nodename + "/")
    same = subprocess.run([sys.executable, "-c", "from kvpool.core.config import default_node_id as d; print(d())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert same == here  # another process of this machine and namespace: the same node
    if os.geteuid() == 0 and subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode == 0:
        other = subprocess.run(["unshare", "--net", sys.executable, "-c",
                                "from kvpool.core.config import default_node_id as d; print(d())"],
                               capture_output=True, text=True, check=True).stdout.strip()
        assert other != here and other.split("/")[:2] == here.split("/")[:2]
