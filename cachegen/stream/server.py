"""ChunkServer: serves a chunk store over TCP, paced by a token bucket.

It plays the remote side of a link: for each request it reads the chunk's record from the
store (prefetching up to ``prefetch`` ahead) and sends it through the link's token bucket,
starting no earlier than ``rtt_ms`` after the request arrived. The bucket is shared by all
connections, as one link would be. Without a rate the socket runs as fast as loopback.

``ChunkServerProcess`` runs the same server in a child process (``python -m
cachegen.stream.server``), as a remote machine would be: its pacing then never waits for
the loader's Python threads (GIL), only for the OS scheduler. The child exits when its
parent closes its stdin, so it cannot outlive the process that started it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cachegen.store.base import ChunkStore
from cachegen.store.errors import StoreError
from cachegen.stream import protocol
from cachegen.stream.errors import StreamError
from cachegen.stream.ratelimit import TokenBucket
from cachegen.stream.traces import BandwidthTrace

log = logging.getLogger(__name__)
SEND_BLOCK = 256 * 1024
STORE_URL_ENV = "CACHEGEN_SERVE_STORE_URL"


class ChunkServer:
    def __init__(
        self,
        store: ChunkStore,
        *,
        rate_mbps: float | BandwidthTrace | None = None,
        rtt_ms: float = 0.0,
        burst_bytes: int | None = None,
        prefetch: int = 2,
        socket_factory: Callable[[], socket.socket] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.store = store
        self.bucket = (
            TokenBucket(rate_mbps, burst_bytes=burst_bytes) if rate_mbps is not None else None
        )
        self.rtt_s = rtt_ms / 1000.0
        self.prefetch = prefetch
        self._factory = socket_factory or (
            lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        )
        self._host = host
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()

    @property
    def address(self) -> tuple[str, int]:
        if self._listener is None:
            raise StreamError("chunk server is not started")
        return self._listener.getsockname()[:2]

    def start(self) -> ChunkServer:
        sock = self._factory()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, 0))
        sock.listen(16)
        self._listener = sock
        self._spawn(self._accept_loop, "cachegen-chunk-accept")
        return self

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in list(self._threads):
            thread.join(timeout=10)

    def __enter__(self) -> ChunkServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self, target, name: str, *args) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            outbox: queue.Queue = queue.Queue(maxsize=self.prefetch)
            done = threading.Event()
            self._spawn(self._read_requests, "cachegen-chunk-read", conn, outbox, done)
            self._spawn(self._send_responses, "cachegen-chunk-send", conn, outbox, done)

    def _read_requests(
        self, conn: socket.socket, outbox: queue.Queue, done: threading.Event
    ) -> None:
        """Parse requests and fetch their records from the store, ``prefetch`` ahead."""
        try:
            while not self._closed.is_set():
                head = _recv_frame_start(conn, protocol.REQUEST.size)
                if head is None:
                    break
                magic, request_id, level, key_len = protocol.REQUEST.unpack(head)
                if magic != protocol.REQUEST_MAGIC or key_len > protocol.MAX_KEY:
                    raise StreamError("client sent a malformed request")
                arrival = time.monotonic()
                if self.bucket is not None:
                    self.bucket.set_origin(arrival)
                key = protocol.recv_exact(conn, key_len, "request key").decode("ascii", "replace")
                try:
                    item = (request_id, arrival, protocol.OK, self.store.get_record(key, level))
                except StoreError as exc:
                    item = (
                        request_id,
                        arrival,
                        protocol.status_of(exc),
                        str(exc).encode()[: protocol.MAX_MESSAGE],
                    )
                if not _put(outbox, item, done):
                    break
        except (OSError, StreamError) as exc:
            log.debug("chunk server connection ended: %s", exc)
        finally:
            _put(outbox, None, done)

    def _send_responses(
        self, conn: socket.socket, outbox: queue.Queue, done: threading.Event
    ) -> None:
        # A connection's first response follows an idle link even when the reader queued it
        # before this thread first looked: otherwise the tokens banked since the link's last
        # use (seconds of them between loads) let a whole load out at loopback speed.
        fresh = True
        try:
            while True:
                try:
                    item = outbox.get_nowait()
                except queue.Empty:  # nothing queued: the link goes idle
                    item, fresh = outbox.get(), True
                if item is None:
                    break
                request_id, arrival, status, body = item
                delay = arrival + self.rtt_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                    fresh = True
                self._send(
                    conn, protocol.pack_response_header(request_id, status, len(body)), fresh
                )
                fresh = False
                view = memoryview(body)
                for start in range(0, len(view), SEND_BLOCK):
                    self._send(conn, view[start : start + SEND_BLOCK])
        except OSError as exc:
            log.debug("chunk server send ended: %s", exc)
        finally:
            done.set()  # the reader stops handing over prefetched chunks
            with self._lock:
                self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _send(self, conn: socket.socket, data, fresh: bool = False) -> None:
        if self.bucket is not None:
            self.bucket.consume(len(data), fresh=fresh)
        conn.sendall(data)


def _put(outbox: queue.Queue, item, done: threading.Event) -> bool:
    """Hand ``item`` to the sender unless it has stopped; False if it has."""
    while not done.is_set():
        try:
            outbox.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _recv_frame_start(conn: socket.socket, n: int) -> bytes | None:
    """The first ``n`` bytes of a frame, or None on a clean end of stream before it."""
    first = conn.recv(n)
    if not first:
        return None
    return first + (
        protocol.recv_exact(conn, n - len(first), "request header") if len(first) < n else b""
    )


class ChunkServerProcess:
    """A ChunkServer in a child process serving the store at ``store_url``."""

    def __init__(
        self,
        store_url: str,
        *,
        rate_mbps: float | BandwidthTrace | None = None,
        rtt_ms: float = 0.0,
        burst_bytes: int | None = None,
        netns: str | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        # The store URL travels in the environment, not argv, so a password in it stays out of `ps`.
        self.store_url = store_url
        cmd = [sys.executable, "-m", "cachegen.stream.server", "--rtt-ms", str(rtt_ms)]
        if isinstance(rate_mbps, BandwidthTrace):
            cmd += ["--trace-json", rate_mbps.to_json()]
        elif rate_mbps is not None:
            cmd += ["--rate-mbps", str(rate_mbps)]
        if burst_bytes is not None:
            cmd += ["--burst-bytes", str(burst_bytes)]
        if netns is not None:
            cmd += ["--netns", netns]
        self.cmd = cmd
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self._address: tuple[str, int] | None = None

    @property
    def address(self) -> tuple[str, int]:
        if self._address is None:
            raise StreamError("chunk server process is not started")
        return self._address

    def start(self) -> ChunkServerProcess:
        # The child must import this very cachegen, installed or not.
        package_root = str(Path(__file__).resolve().parents[2])
        env = {
            **os.environ,
            STORE_URL_ENV: self.store_url,
            "PYTHONPATH": os.pathsep.join(
                filter(None, [package_root, os.environ.get("PYTHONPATH")])
            ),
        }
        self.proc = subprocess.Popen(
            self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        line = _readline_with_timeout(self.proc.stdout, self.start_timeout_s)
        if not line.startswith(b"LISTENING "):
            err = self._stop_and_collect()
            raise StreamError(
                f"chunk server process failed to start: {err or line.decode(errors='replace')}"
            )
        host, port = line.split()[1].decode().rsplit(":", 1)
        self._address = (host, int(port))
        return self

    def _stop_and_collect(self) -> str:
        if self.proc is None:
            return ""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        err = self.proc.stderr.read().decode(errors="replace").strip()
        self.proc.stdout.close()
        self.proc.stderr.close()
        self.proc = None
        return err.splitlines()[-1] if err else ""

    def close(self) -> None:
        self._stop_and_collect()

    def __enter__(self) -> ChunkServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _readline_with_timeout(stream, timeout_s: float) -> bytes:
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return out[0] if out else b""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the child process: serve until stdin closes."""
    from cachegen.store import open_store

    p = argparse.ArgumentParser(prog="python -m cachegen.stream.server")
    p.add_argument("--rate-mbps", type=float)
    p.add_argument("--trace-json")
    p.add_argument("--rtt-ms", type=float, default=0.0)
    p.add_argument("--burst-bytes", type=int)
    p.add_argument("--netns")
    args = p.parse_args(argv)
    rate = BandwidthTrace.from_json(args.trace_json) if args.trace_json else args.rate_mbps
    factory = None
    if args.netns:
        from cachegen.stream.netns import socket_in

        factory = functools.partial(socket_in, args.netns)
    store_url = os.environ.get(STORE_URL_ENV)
    if not store_url:
        p.error(f"set {STORE_URL_ENV} to the URL of the store to serve")
    store = open_store(store_url)
    with ChunkServer(
        store,
        rate_mbps=rate,
        rtt_ms=args.rtt_ms,
        burst_bytes=args.burst_bytes,
        socket_factory=factory,
    ) as server:
        host, port = server.address
        sys.stdout.write(f"LISTENING {host}:{port}\n")
        sys.stdout.flush()
        sys.stdin.buffer.read()  # until the parent closes the pipe (or dies)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
