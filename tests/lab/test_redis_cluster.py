"""The lab's local Redis Cluster (lab/cachegen_lab/redis_cluster.py): it starts six real nodes,
serves a store, and leaves nothing behind: not after stop(), not after a failed start, and
without redis-server or redis-cli it starts nothing at all."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cachegen.errors import InputError
from cachegen.store import open_store
from cachegen_lab.redis_cluster import LocalClusterError, LocalRedisCluster
from tests.support import require_tool

PASSWORD = "p@ss/w:rd%1"  # characters a URL must quote
SECRET = "lab-cluster-secret"


class Recording(LocalRedisCluster):
    """Keeps every node process it starts, so that a test can check each has ended."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.started = []
        self.seen_root: Path | None = None  # stop() forgets a directory it made

    def start_node(self, port: int) -> None:
        self.seen_root = self.root
        try:
            super().start_node(port)
        finally:
            self.started.append(self.procs[port])


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _assert_nothing_left(cluster: Recording) -> None:
    assert cluster.started and all(proc.poll() is not None for proc in cluster.started)
    assert cluster.alive() == []
    assert not any(_listening(port) for port in cluster.ports)
    assert not cluster.seen_root.exists()


def test_a_local_cluster_serves_a_store_and_stops_without_a_trace():
    require_tool("redis-server")
    require_tool("redis-cli")
    cluster = Recording(password=PASSWORD, query="timeout_s=2")
    assert len(set(cluster.ports)) == 6
    with cluster:
        root = cluster.root
        assert root is not None and root.is_dir()
        assert len(cluster.started) == 6
        # The password is in files only this user can read, never on a command line or in a URL.
        assert cluster.url().startswith("redis+cluster://127.0.0.1:") and PASSWORD not in (
            cluster.url()
        )
        assert not any(PASSWORD in " ".join(proc.args) for proc in cluster.started)
        assert cluster.password_file.stat().st_mode & 0o077 == 0
        assert {cluster.info(p)["cluster_state"] for p in cluster.ports} == {"ok"}
        # Any node is an entry point; each key goes to the master of its slot.
        with open_store(cluster.url(), secret=SECRET) as store:
            assert store.cluster
            for i in range(12):
                store.put(f"ns/chunk{i:02d}", 0, bytes([i]) * 64)
        with open_store(cluster.url(port=cluster.ports[-1]), secret=SECRET) as store:
            assert [store.get(f"ns/chunk{i:02d}", 0) for i in range(12)] == [
                bytes([i]) * 64 for i in range(12)
            ]
    _assert_nothing_left(cluster)
    cluster.stop()  # idempotent
    assert not root.exists()


def test_a_failed_creation_stops_the_nodes_it_started(tmp_path, monkeypatch):
    """redis-server starts every node; a redis-cli that fails leaves the cluster uncreated."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "redis-server").symlink_to(require_tool("redis-server"))
    fake_cli = bin_dir / "redis-cli"
    fake_cli.write_text("#!/bin/sh\necho 'ERR: no cluster today' >&2\nexit 1\n")
    fake_cli.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    cluster = Recording()
    with pytest.raises(LocalClusterError, match="no cluster today"):
        cluster.start()
    assert len(cluster.started) == 6
    _assert_nothing_left(cluster)


@pytest.mark.parametrize("present", [(), ("redis-server",), ("redis-cli",)])
def test_without_redis_it_says_what_to_install_and_starts_nothing(tmp_path, monkeypatch, present):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ran = tmp_path / "ran"
    for name in present:  # a stand-in that would leave a mark if anything ran it
        (bin_dir / name).write_text(f"#!/bin/sh\ntouch {ran}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    root = tmp_path / "nodes"
    cluster = LocalRedisCluster(root=root)
    with pytest.raises(InputError) as raised:
        with cluster:
            pass
    message = str(raised.value)
    missing = {"redis-server", "redis-cli"} - set(present)
    assert all(name in message for name in missing)
    assert "apt-get install redis-server" in message
    assert not ran.exists() and not root.exists() and cluster.alive() == []
