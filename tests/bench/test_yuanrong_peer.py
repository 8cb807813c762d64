"""openYuanrong datasystem as a bench peer (`--peer yuanrong`): its worker started and stopped by the
bench, failures as BenchError, kvpool's same-node path set against its KVClient, size by size.

Those that drive a real datasystem worker are marked `peers` and need `pip install -e '.[peers]'`
(without it they are skipped, saying so); the message for a missing package is checked everywhere."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.core import BenchError
from kvpool.core.bench import yuanrong_peer

needs_yuanrong = pytest.mark.skipif(not yuanrong_peer.available(),
                                    reason=f"openYuanrong datasystem is not installed: {yuanrong_peer.INSTALL}")


@pytest.fixture
def tmp_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This process's temporary folders (the workers' state included) go under a folder of the test's
    own, so what is left behind is seen whatever else runs on the machine. A short path: the worker's
    Unix sockets live in its state folder (pytest's tmp_path is too long for them)."""
    root = Path(tempfile.mkdtemp(prefix="yrt-"))
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    shutil.rmtree(root)


def _left(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_without_the_package_the_peer_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_root: Path) -> None:
    monkeypatch.setitem(sys.modules, "yr", None)  # `import yr.datasystem` fails as if it were absent
    monkeypatch.setitem(sys.modules, "yr.datasystem", None)
    with pytest.raises(BenchError, match=r"openyuanrong-datasystem.*pip install -e '\.\[peers\]'"):
        yuanrong_peer.Worker().start()
    assert _left(tmp_root) == []
    assert not yuanrong_peer.available()


@pytest.mark.peers
@needs_yuanrong
def test_a_state_folder_too_long_for_its_sockets_is_refused_before_it_starts(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with pytest.raises(BenchError, match="too long a path for its Unix socket.*TMPDIR"):
        yuanrong_peer.Worker().start()
    assert list(deep.iterdir()) == []


def test_size_tags() -> None:
    assert [yuanrong_peer.size_tag(b) for b in yuanrong_peer.SIZES] == ["_64k", "_256k", "_1m"]
    assert yuanrong_peer.size_tag(16 << 10) == "_16k" and yuanrong_peer.size_tag(4 << 20) == "_4m"


@pytest.mark.peers
@needs_yuanrong
def test_worker_serves_then_leaves_nothing(tmp_root: Path) -> None:
    with yuanrong_peer.Worker() as w:
        assert w.proc is not None
        pid = w.proc.pid
        assert [name[:16] for name in _left(tmp_root)] == ["kvpool-yuanrong-"]
        kv = w.kv_client()
        kv.set("k", b"value")
        assert kv.get(["k"]) == [b"value"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert _left(tmp_root) == []


@pytest.mark.peers
@needs_yuanrong
def test_a_worker_that_fails_to_start_is_a_clear_bench_error(tmp_root: Path) -> None:
    with pytest.raises(BenchError, match=r"worker on 127\.0\.0\.1:\d+ exited with status \d+ before it was "
                                         r"ready: .*oc_shm_transfer_threshold_kb"):
        yuanrong_peer.Worker(shm_threshold_kb=-5).start().wait_ready()  # a value its flags refuse
    assert _left(tmp_root) == []


@pytest.mark.peers
@needs_yuanrong
def test_same_node_sets_every_size_against_its_best_method(tmp_root: Path) -> None:
    metrics, ratios = yuanrong_peer.same_node(2 << 20, 16, 1)
    for tag in ("_64k", "_256k", "_1m"):
        for op in ("put", "get"):
            assert ratios[f"shm_{op}_vs_yuanrong{tag}"] > 0
            best = metrics[f"yuanrong_{op}{tag}_best_method"]
            assert metrics[f"yuanrong_{op}_{best}{tag}_gbps"] == metrics[f"yuanrong_{op}{tag}_gbps"] > 0
            assert metrics[f"kvpool_shm_{op}{tag}_gbps"] > 0
        # zero-copy and copying methods, with its shared-memory threshold at its default and at 0
        assert {"yuanrong_put_mcreate_shm0" + tag + "_gbps", "yuanrong_get_get_buffers" + tag + "_gbps",
                "yuanrong_get_get_shm0" + tag + "_gbps"} <= set(metrics)
    for path in ("kvpool_shm", "yuanrong", "yuanrong_shm0"):  # one-key gets, 64 KiB
        assert 0 < metrics[f"{path}_get_one_64k_p50_us"] <= metrics[f"{path}_get_one_64k_p99_us"]
    assert "yuanrong_put_mset_64k_gbps" in metrics and "yuanrong_put_mset_1m_gbps" not in metrics  # mset < 500 KiB
    assert _left(tmp_root) == []
