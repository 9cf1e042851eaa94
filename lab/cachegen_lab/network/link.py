"""``open_link``: a bandwidth-limited path from a store to a loader, in one call.

    with open_link(store, bandwidth_mbps=100, rtt_ms=10, shaper="token-bucket") as link:
        records = [RecordAddress.of(key, "cachegen-2") for key in keys]
        stats = stream_load(link.source, records, decode, consume)

Shapers:
  * ``token-bucket`` (portable default): a ChunkServer on 127.0.0.1 paces its sends with a
    token bucket (a constant rate or a BandwidthTrace) and delays each response by the RTT.
  * ``netns`` (Linux, root): the ChunkServer and the loader's sockets live in a private
    network namespace whose loopback the kernel shapes with ``tc tbf``; the RTT comes from
    ``netem`` where the kernel has it, else from the server as above.
  * ``none``: the loader reads the store directly in its fetch thread (no socket, no limit).

The server runs in a child process by default (``server="process"``), as the remote side
of a real link would; ``server="thread"`` keeps it in this process (faster to start, but
its pacing then competes with the loader's threads for the GIL).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from cachegen.errors import InputError
from cachegen.store.base import ChunkStore
from cachegen.stream.source import ChunkSource, DirectSource
from cachegen_lab.network.netns import NetnsShaper
from cachegen_lab.network.server import ChunkServer, ChunkServerProcess
from cachegen_lab.network.socket_source import SocketSource
from cachegen_lab.network.traces import BandwidthTrace

SHAPERS = ("token-bucket", "netns", "none")
RATE_SHAPERS = SHAPERS[:2]  # the ones that can enforce a bandwidth
SERVER_MODES = ("process", "thread")


@dataclass
class Link:
    source: ChunkSource
    shaper: str
    bandwidth_mbps: float | None  # None: unlimited, or a trace (see trace)
    rtt_ms: float
    rtt_emulation: str  # "netem", "server" or "none"
    trace: BandwidthTrace | None = None
    server: ChunkServer | ChunkServerProcess | None = None
    netns: NetnsShaper | None = None

    def describe(self) -> dict:
        return {
            "shaper": self.shaper,
            "bandwidth_mbps": self.bandwidth_mbps,
            "trace": self.trace.name if self.trace else None,
            "rtt_ms": self.rtt_ms,
            "rtt_emulation": self.rtt_emulation,
            "netns": self.netns.name if self.netns else None,
            "qdisc": self.netns.qdisc() if self.netns else None,
        }


@contextlib.contextmanager
def open_link(
    store: ChunkStore,
    *,
    bandwidth_mbps: float | BandwidthTrace | None = None,
    rtt_ms: float = 0.0,
    shaper: str = "token-bucket",
    burst_bytes: int | None = None,
    server: str = "process",
) -> Iterator[Link]:
    if shaper not in SHAPERS:
        raise InputError(f"unknown shaper {shaper!r}; choose one of {', '.join(SHAPERS)}")
    if server not in SERVER_MODES:
        raise InputError(f"unknown server mode {server!r}; choose one of {', '.join(SERVER_MODES)}")
    if rtt_ms < 0:
        raise InputError(f"rtt_ms must be >= 0, got {rtt_ms}")
    trace = bandwidth_mbps if isinstance(bandwidth_mbps, BandwidthTrace) else None
    rate = None if trace else bandwidth_mbps
    if rate is not None and rate <= 0:
        raise InputError(f"bandwidth must be positive, got {rate} Mbit/s")
    if shaper == "none":
        if bandwidth_mbps is not None or rtt_ms:
            raise InputError(
                "shaper 'none' reads the store directly; "
                "drop --bandwidth-mbps/--rtt-ms or pick a shaper"
            )
        yield Link(DirectSource(store), shaper, None, 0.0, "none")
        return
    if shaper == "netns":
        if trace is not None or rate is None:
            raise InputError(
                "the netns shaper needs a constant --bandwidth-mbps (traces run with token-bucket)"
            )
        with NetnsShaper(rate, rtt_ms=rtt_ms, burst_bytes=burst_bytes) as ns:
            server_rtt = 0.0 if ns.kernel_rtt else rtt_ms
            with _server(store, server, rtt_ms=server_rtt, netns=ns) as srv:
                emulation = "netem" if ns.kernel_rtt else ("server" if rtt_ms else "none")
                source = SocketSource(srv.address, socket_factory=ns.socket, **_checks(store))
                yield Link(source, shaper, rate, rtt_ms, emulation, server=srv, netns=ns)
        return
    with _server(
        store, server, rate_mbps=bandwidth_mbps, rtt_ms=rtt_ms, burst_bytes=burst_bytes
    ) as srv:
        emulation = "server" if rtt_ms else "none"
        # The server forwards records as stored; this end verifies them with the store's secret.
        source = SocketSource(srv.address, **_checks(store))
        yield Link(source, shaper, rate, rtt_ms, emulation, trace, server=srv)


def _checks(store: ChunkStore) -> dict:
    """What the receiving end checks as the store would: its secret and its record cap."""
    checks: dict = {"secret": store.record_signer}
    if store.max_record_bytes is not None:
        checks["max_chunk_bytes"] = store.max_record_bytes
    return checks


def _server(store: ChunkStore, mode: str, *, netns: NetnsShaper | None = None, **kw):
    if mode == "process":
        return ChunkServerProcess(store.url, netns=netns.name if netns else None, **kw)
    return ChunkServer(store, socket_factory=netns.socket if netns else None, **kw)
