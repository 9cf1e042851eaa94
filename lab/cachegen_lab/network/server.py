"""ChunkServer: serves a chunk store over TCP, paced by a token bucket.

It plays the remote side of a link: for each request (a record's address: chunk key, part and
form name, ``protocol``) it reads the record from the store and sends it through the link's
token bucket, starting no earlier than ``rtt_ms`` after
the request arrived. The bucket is shared by all connections, as one link would be. Without a
rate the socket runs as fast as loopback.

Each connection has three threads: a reader parses requests, a fetcher reads their records
from the store ahead of the sender, at most ``prefetch`` chunks and about ``prefetch_bytes``
bytes ahead, and a sender puts them on the wire. So the store's latency overlaps the transfer
of earlier chunks instead of showing as link idle time. Small records share a store round trip
(up to about ``FETCH_BATCH_BYTES``); large ones, and the first
after the sender went idle, are read one by one, so the sender waits for one record, never
for a batch.

``ChunkServerProcess`` runs the same server in a child process (``python -m
cachegen_lab.network.server``), as a remote machine would be: its pacing then never waits for
the loader's Python threads (GIL), only for the OS scheduler. The child exits when its
parent closes its stdin, so it cannot outlive the process that started it.
"""

from __future__ import annotations

import argparse
import collections
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
from typing import Any

import cachegen
import cachegen_lab
from cachegen.errors import CacheGenError, InputError
from cachegen.store.base import ChunkStore
from cachegen.store.errors import StoreError
from cachegen.stream.errors import StreamError
from cachegen.stream.source import FETCH_BATCH_BYTES
from cachegen_lab.network import protocol
from cachegen_lab.network.ratelimit import TokenBucket
from cachegen_lab.network.traces import BandwidthTrace

log = logging.getLogger(__name__)
# Bytes per paced send: 256 KiB, or what the link carries in SEND_BLOCK_S at its peak rate if
# that is more. Each send costs a bucket update, a sleep and a syscall; at several Gbit/s that
# overhead, not the link, would bound the rate with small blocks.
SEND_BLOCK = 256 * 1024
SEND_BLOCK_S = 0.002
STORE_URL_ENV = "CACHEGEN_SERVE_STORE_URL"
DEFAULT_PREFETCH = 4
DEFAULT_PREFETCH_BYTES = 32 * 1024 * 1024
MAX_PENDING_REQUESTS = 4096  # parsed, not yet fetched; beyond, TCP pushes back on the client


class ChunkServer:
    def __init__(
        self,
        store: ChunkStore,
        *,
        rate_mbps: float | BandwidthTrace | None = None,
        rtt_ms: float = 0.0,
        burst_bytes: int | None = None,
        prefetch: int = DEFAULT_PREFETCH,
        prefetch_bytes: int = DEFAULT_PREFETCH_BYTES,
        socket_factory: Callable[[], socket.socket] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.store = store
        self.bucket = (
            TokenBucket(rate_mbps, burst_bytes=burst_bytes) if rate_mbps is not None else None
        )
        self.rtt_s = rtt_ms / 1000.0
        self.send_block = (
            max(SEND_BLOCK, int(self.bucket.peak_bytes_per_s * SEND_BLOCK_S))
            if self.bucket is not None
            else None  # unpaced: each body in one send
        )
        if prefetch < 1 or prefetch_bytes < 1:
            raise InputError(
                f"prefetch and prefetch_bytes must be >= 1, got {prefetch} and {prefetch_bytes}"
            )
        self.prefetch = prefetch
        self.prefetch_bytes = prefetch_bytes
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
            requests: queue.Queue = queue.Queue(maxsize=MAX_PENDING_REQUESTS)
            outbox = _Outbox(self.prefetch, self.prefetch_bytes)
            self._spawn(self._read_requests, "cachegen-chunk-read", conn, requests, outbox)
            self._spawn(self._fetch_records, "cachegen-chunk-fetch", requests, outbox)
            self._spawn(self._send_responses, "cachegen-chunk-send", conn, outbox)

    def _read_requests(self, conn: socket.socket, requests: queue.Queue, outbox: _Outbox) -> None:
        """Parse requests and queue them for the fetcher, as fast as they arrive."""
        try:
            while not self._closed.is_set():
                head = _recv_frame_start(conn, protocol.REQUEST.size)
                if head is None:
                    break
                magic, request_id, key_len, part_len, form_len = protocol.REQUEST.unpack(head)
                if magic != protocol.REQUEST_MAGIC or key_len > protocol.MAX_KEY:
                    raise StreamError("client sent a malformed request")
                arrival = time.monotonic()
                if self.bucket is not None:
                    self.bucket.set_origin(arrival)
                raw = protocol.recv_exact(conn, key_len + part_len + form_len, "request address")
                key, part = raw[:key_len], raw[key_len : key_len + part_len]
                try:
                    address = protocol.unpack_address(key, part, raw[key_len + part_len :])
                except CacheGenError as exc:  # names no record: that request fails, not the rest
                    address = exc
                if not _put(requests, (request_id, arrival, address), outbox):
                    break
        except (OSError, StreamError) as exc:
            log.debug("chunk server connection ended: %s", exc)
        finally:
            _put(requests, None, outbox)

    def _fetch_records(self, requests: queue.Queue, outbox: _Outbox) -> None:
        """Read the queued requests' records from the store ahead of the sender, a batch per
        store round trip, within the outbox's bounds; a request that fails gets its error."""
        largest = 0  # the largest record read so far on this connection
        try:
            while True:
                room = outbox.wait_for_room()
                first = _next_request(requests, outbox) if room else None
                if first is None:
                    return  # no more requests, or the sender stopped
                batch = [first]
                # A batch arrives whole: large records go one by one, so the next one is ready
                # as soon as possible; small ones share a round trip.
                limit = min(room, max(1, FETCH_BATCH_BYTES // max(1, largest)))
                while len(batch) < limit:
                    try:
                        batch.append(requests.get_nowait())
                    except queue.Empty:
                        break
                ended = batch[-1] is None
                responses = self._responses(batch[:-1] if ended else batch)
                largest = max([largest, *(len(body) for *_, body in responses)])
                outbox.put_all(responses)
                if ended:
                    return
        finally:
            outbox.put_all([None])  # the sender ends the connection after what is queued

    def _responses(self, batch: list) -> list:
        """The response to each request of ``batch``: its record as stored (the client verifies
        it), or the error that request met."""
        wanted = [address for *_, address in batch if not isinstance(address, CacheGenError)]
        found = iter(self.store.read_records(wanted) if wanted else [])
        out = []
        for request_id, arrival, address in batch:
            record = address if isinstance(address, CacheGenError) else next(found)
            if isinstance(record, CacheGenError):
                body = str(record).encode()[: protocol.MAX_MESSAGE]
                status = (
                    protocol.status_of(record) if isinstance(record, StoreError) else protocol.ERROR
                )
                out.append((request_id, arrival, status, body))
            else:
                out.append((request_id, arrival, protocol.OK, record))
        return out

    def _send_responses(self, conn: socket.socket, outbox: _Outbox) -> None:
        # A connection's first response follows an idle link even when the fetcher queued it
        # before this thread first looked: otherwise the tokens banked since the link's last
        # use (seconds of them between loads) let a whole load out at loopback speed.
        fresh = True
        try:
            while True:
                item, waited = outbox.get()
                fresh = fresh or waited  # nothing was queued: the link went idle
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
                block = self.send_block or max(1, len(view))
                for start in range(0, len(view), block):
                    self._send(conn, view[start : start + block])
                del view
                outbox.sent(len(body))
        except OSError as exc:
            log.debug("chunk server send ended: %s", exc)
        finally:
            outbox.close()  # the fetcher stops fetching ahead
            with self._lock:
                self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _send(self, conn: socket.socket, data, fresh: bool = False) -> None:
        if self.bucket is not None:
            self.bucket.consume(len(data), fresh=fresh)
        conn.sendall(data)


class _Outbox:
    """Responses fetched and not yet sent on one connection: at most ``max_chunks`` of them,
    and no new fetch once ``max_bytes`` are waiting (a batch may go over by its own size)."""

    def __init__(self, max_chunks: int, max_bytes: int) -> None:
        self.max_chunks, self.max_bytes = max_chunks, max_bytes
        self._items: collections.deque = collections.deque()
        self._bytes = 0  # bodies queued or being sent
        self._cond = threading.Condition()
        self.closed = False

    def wait_for_room(self) -> int:
        """How many responses may be fetched now (waits for at least one); 0 once closed.

        One while the sender is idle: it waits for those bytes alone, not for a batch."""
        with self._cond:
            while not self.closed and (
                len(self._items) >= self.max_chunks or self._bytes >= self.max_bytes
            ):
                self._cond.wait()
            if self.closed:
                return 0
            return 1 if not self._items and not self._bytes else self.max_chunks - len(self._items)

    def put_all(self, items: list) -> None:
        with self._cond:
            for item in items:
                self._items.append(item)
                if item is not None:
                    self._bytes += len(item[3])
            self._cond.notify_all()

    def get(self) -> tuple:
        """The next response (None: no more) and whether the sender had to wait for it."""
        with self._cond:
            waited = not self._items
            while not self._items:
                self._cond.wait()
            return self._items.popleft(), waited

    def sent(self, nbytes: int) -> None:
        with self._cond:
            self._bytes -= nbytes
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


def _next_request(requests: queue.Queue, outbox: _Outbox):
    """The next parsed request; None when the reader ended or the sender stopped."""
    while not outbox.closed:
        try:
            return requests.get(timeout=0.1)
        except queue.Empty:
            continue
    return None


def _put(requests: queue.Queue, item, outbox: _Outbox) -> bool:
    """Queue ``item`` for the fetcher unless the sender has stopped; False if it has."""
    while not outbox.closed:
        try:
            requests.put(item, timeout=0.1)
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
        netns: str | None = None,
        start_timeout_s: float = 30.0,
        **pacing: Any,
    ) -> None:
        """``pacing``: the child's :class:`ChunkServer` pacing (``rate_mbps``, ``rtt_ms``,
        ``burst_bytes``)."""
        # The store URL travels in the environment, not argv, so a password in it stays out of `ps`.
        self.store_url = store_url
        self.cmd = [sys.executable, "-m", "cachegen_lab.network.server", *_pacing_args(**pacing)]
        if netns is not None:
            self.cmd += ["--netns", netns]
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self._address: tuple[str, int] | None = None

    @property
    def address(self) -> tuple[str, int]:
        if self._address is None:
            raise StreamError("chunk server process is not started")
        return self._address

    def start(self) -> ChunkServerProcess:
        # The child must import this very cachegen and lab, installed or not.
        package_roots = [
            str(Path(p.__file__).resolve().parents[1]) for p in (cachegen, cachegen_lab)
        ]
        env = {
            **os.environ,
            STORE_URL_ENV: self.store_url,
            "PYTHONPATH": os.pathsep.join(
                filter(None, [*package_roots, os.environ.get("PYTHONPATH")])
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


def _pacing_args(
    rate_mbps: float | BandwidthTrace | None = None,
    rtt_ms: float = 0.0,
    burst_bytes: int | None = None,
) -> list[str]:
    """The child's command-line options for :class:`ChunkServer`'s pacing arguments."""
    args = ["--rtt-ms", str(rtt_ms)]
    if isinstance(rate_mbps, BandwidthTrace):
        args += ["--trace-json", rate_mbps.to_json()]
    elif rate_mbps is not None:
        args += ["--rate-mbps", str(rate_mbps)]
    if burst_bytes is not None:
        args += ["--burst-bytes", str(burst_bytes)]
    return args


def _readline_with_timeout(stream, timeout_s: float) -> bytes:
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return out[0] if out else b""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the child process: serve until stdin closes."""
    from cachegen.store import open_store

    p = argparse.ArgumentParser(prog="python -m cachegen_lab.network.server")
    p.add_argument("--rate-mbps", type=float)
    p.add_argument("--trace-json")
    p.add_argument("--rtt-ms", type=float, default=0.0)
    p.add_argument("--burst-bytes", type=int)
    p.add_argument("--netns")
    args = p.parse_args(argv)
    rate = BandwidthTrace.from_json(args.trace_json) if args.trace_json else args.rate_mbps
    factory = None
    if args.netns:
        from cachegen_lab.network.netns import socket_in

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
