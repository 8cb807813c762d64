"""The multihost fixture: a lab of 4 hosts with the cluster of mhcluster.py, built once per module and
torn down after it (processes, namespaces, links), also after a failure."""
from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from mhcluster import Cluster
from netlab import Lab, can_build

_why_not = can_build()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if _why_not is not None:
        pytest.skip(f"multihost tests: {_why_not}")
    workdir = tmp_path_factory.mktemp("multihost")
    os.chmod(workdir, 0o755)
    lab = Lab(4, workdir)
    c: Cluster | None = None
    try:
        c = Cluster(lab, workdir)
        yield c
    finally:
        if c is not None:
            c.close()
        lab.close()
        assert not lab.leftovers(), f"namespaces left behind: {lab.leftovers()}"
