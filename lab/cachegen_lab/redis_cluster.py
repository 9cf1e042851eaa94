"""A real Redis Cluster on this machine: ``size`` ``redis-server`` processes in cluster mode
on free loopback ports, joined with ``redis-cli --cluster create`` (one replica per master).

``cachegen fleet-bench --store local-cluster`` measures on one, and the tests' cluster fixture
(tests/conftest.py) builds its failure helpers on it. Lab-only: the serving library never
starts Redis.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlencode

from cachegen.errors import CacheGenError, InputError

BUS_OFFSET = 10000  # redis-server listens for the cluster bus on port + 10000
MAX_EPHEMERAL = 60999  # the highest port Linux hands out for bind(port 0)
START_TIMEOUT_S = 10.0
CREATE_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
LOG_TAIL_LINES = 20


class LocalClusterError(CacheGenError):
    """The local Redis Cluster did not start, or did not become ok."""


def free_cluster_port(taken: set[int] | None = None) -> int:
    """A free loopback port whose cluster bus port (port + 10000) is free too and exists:
    redis-server in cluster mode exits at start-up otherwise. Neither port is in ``taken``;
    both are added to it, so that the nodes of one cluster differ."""
    taken = set() if taken is None else taken
    for _ in range(1000):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port + BUS_OFFSET > MAX_EPHEMERAL or port in taken or port + BUS_OFFSET in taken:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + BUS_OFFSET))
            except OSError:
                continue
        taken.update((port, port + BUS_OFFSET))
        return port
    raise LocalClusterError("no free port pair (port and port + 10000) for a Redis Cluster node")


def redis_binaries() -> tuple[str, str]:
    """The paths of ``redis-server`` and ``redis-cli``; InputError naming the missing ones."""
    found = {name: shutil.which(name) for name in ("redis-server", "redis-cli")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise InputError(
            f"a local Redis Cluster needs {' and '.join(missing)}, not found on PATH: install "
            "Redis (Debian/Ubuntu: apt-get install redis-server, which has both)"
        )
    return found["redis-server"], found["redis-cli"]


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to a new ``path`` that only its owner can read (mode 600 from the
    start, so no one else can open it in between)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def _log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-LOG_TAIL_LINES:]) or "(empty log)"


class LocalRedisCluster:
    """``size`` redis-server nodes (``size // 2`` masters, each with a replica) in ``root``
    (default: a temporary directory, removed by :meth:`stop`). ``password`` sets
    ``requirepass`` and ``masterauth`` on every node, through files in ``root`` that only this
    user can read, never a command line; :meth:`url` names it by that file. ``query`` holds the
    store options that :meth:`url` adds. Start with :meth:`start` or ``with``; :meth:`stop`
    ends every node."""

    def __init__(
        self,
        size: int = 6,
        *,
        password: str | None = None,
        root: Path | str | None = None,
        query: str = "",
        node_timeout_ms: int = 5000,
    ) -> None:
        if size < 6:  # redis-cli refuses fewer than 3 masters
            raise InputError(
                f"a Redis Cluster of masters and replicas needs 6 nodes or more, not {size}"
            )
        self.size = size
        self.password = password
        self.query = query
        # How long a silent node takes to be marked failed (and its replica promoted).
        self.node_timeout_ms = node_timeout_ms
        self.root = None if root is None else Path(root)
        self._made_root = False
        taken: set[int] = set()
        self.ports = [free_cluster_port(taken) for _ in range(size)]
        self.procs: dict[int, subprocess.Popen | None] = {p: None for p in self.ports}
        self._server = self._cli = ""

    def __enter__(self) -> LocalRedisCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def url(self, port: int | None = None, query: str | None = None) -> str:
        """The ``redis+cluster://`` store URL with ``port`` (default: the first node) as entry
        point and ``query`` (default: the cluster's) as store options; with a password, its
        ``password_file`` (written by :meth:`start`)."""
        query = self.query if query is None else query
        if self.password:
            if self.root is None:
                raise LocalClusterError("start the cluster first: its password file is made then")
            named = urlencode({"password_file": self.password_file}, safe="/")
            query = f"{query}&{named}" if query else named
        tail = f"?{query}" if query else ""
        return f"redis+cluster://127.0.0.1:{port or self.ports[0]}{tail}"

    @property
    def password_file(self) -> Path:
        """The file holding the password (``requirepass``), readable by its owner only."""
        return self.root / "password"

    def cli_env(self) -> dict[str, str]:
        """The environment of a ``redis-cli`` run on this cluster: the password in
        ``REDISCLI_AUTH``, not on its command line."""
        return {**os.environ, "REDISCLI_AUTH": self.password} if self.password else dict(os.environ)

    def start(self) -> None:
        """Start every node, create the cluster and wait until it is ok; on any failure every
        node started so far is stopped again."""
        self._server, self._cli = redis_binaries()  # before anything starts
        try:
            if self.root is None:
                self.root = Path(tempfile.mkdtemp(prefix="cachegen-redis-cluster-"))
                self._made_root = True
            if self.password:
                _write_private(self.password_file, self.password)
            for port in self.ports:
                self.start_node(port)
            self._create()
            self.wait_ok()
        except BaseException:
            self.stop()
            raise

    def start_node(self, port: int) -> None:
        """Start (or restart, keeping its nodes.conf) the node on ``port``; returns once it
        accepts connections. Its output goes to redis.log in its directory."""
        directory = self.root / str(port)
        directory.mkdir(parents=True, exist_ok=True)
        args = [self._server]
        if self.password:  # a config file: redis-server's arguments are seen by `ps`
            auth = directory / "auth.conf"
            _write_private(auth, f"requirepass {self.password}\nmasterauth {self.password}\n")
            args.append(str(auth))
        args += [
            "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory),
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--appendonly", "no", "--save", "",
        ]  # fmt: skip
        log = directory / "redis.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        self.procs[port] = proc
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(OSError):
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return
            if proc.poll() is not None or time.monotonic() > deadline:
                raise LocalClusterError(
                    f"redis-server did not start on port {port}; its log:\n{_log_tail(log)}"
                )
            time.sleep(0.02)

    def _create(self) -> None:
        cmd = [self._cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports)]
        cmd += ["--cluster-replicas", "1", "--cluster-yes"]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=CREATE_TIMEOUT_S, env=self.cli_env()
            )
        except subprocess.TimeoutExpired:
            raise LocalClusterError(
                f"redis-cli --cluster create did not finish in {CREATE_TIMEOUT_S:.0f} s"
            ) from None
        if done.returncode != 0:
            raise LocalClusterError(
                f"redis-cli --cluster create failed (exit {done.returncode}):\n"
                f"{(done.stdout + done.stderr).strip()}"
            )

    def client(self, port: int):
        """A plain (non-cluster) redis-py client of the node on ``port``."""
        import redis

        return redis.Redis(
            port=port, password=self.password, socket_timeout=2, socket_connect_timeout=2
        )

    def info(self, port: int) -> dict[str, str]:
        """The node's ``CLUSTER INFO``."""
        with contextlib.closing(self.client(port)) as c:
            return {k: str(v) for k, v in c.cluster("info").items()}

    def alive(self) -> list[int]:
        """The ports of the nodes running (started and not stopped)."""
        return [p for p, proc in self.procs.items() if proc is not None]

    def wait_ok(self, timeout_s: float = 20.0, masters: int | None = None) -> float:
        """Wait until every live node says cluster_state:ok and sees ``masters`` (default:
        half the nodes) masters with slots; returns the seconds waited."""
        import redis

        masters = self.size // 2 if masters is None else masters
        t0 = time.monotonic()
        states: dict[int, str] = {}
        while True:
            states = {}
            for port in self.alive():
                try:
                    info = self.info(port)
                    states[port] = f"{info['cluster_state']}, {info['cluster_size']} masters"
                except (redis.RedisError, KeyError) as exc:
                    states[port] = f"no answer ({type(exc).__name__})"
            if all(s == f"ok, {masters} masters" for s in states.values()):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                shown = "; ".join(f"127.0.0.1:{p}: {s}" for p, s in states.items())
                raise LocalClusterError(
                    f"the Redis Cluster was not ok with {masters} masters after {timeout_s} s "
                    f"({shown})"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """Terminate every node and wait for it; remove the directory if this made it. Safe to
        call again, and after a failed start."""
        for port, proc in self.procs.items():
            if proc is None:
                continue
            proc.terminate()
            # A node stopped by SIGSTOP acts on SIGTERM only once continued.
            proc.send_signal(signal.SIGCONT)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self.procs[port] = None
        if self._made_root and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
            self._made_root = False
