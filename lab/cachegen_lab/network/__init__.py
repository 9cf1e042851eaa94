"""Link emulation for experiments: a store served over TCP at a shaped rate and RTT.

    from cachegen_lab.network import open_link
    from cachegen.stream import stream_load

    with open_link(store, bandwidth_mbps=100, rtt_ms=10, shaper="token-bucket") as link:
        records = [RecordAddress.of(key, "cachegen-2") for key in keys]
        stats = stream_load(link.source, records, decode, consume)

The lab's connector (``cachegen_lab.connector``) opens links here when a request to it sets
``bandwidth_mbps`` or ``rtt_ms``; nothing in the library imports this package.
See docs/streaming.md.
"""

from cachegen_lab.network.link import SHAPERS, Link, open_link
from cachegen_lab.network.netns import ShaperUnavailable
from cachegen_lab.network.server import ChunkServer, ChunkServerProcess
from cachegen_lab.network.socket_source import SocketSource
from cachegen_lab.network.traces import BandwidthTrace

__all__ = [
    "SHAPERS",
    "BandwidthTrace",
    "ChunkServer",
    "ChunkServerProcess",
    "Link",
    "ShaperUnavailable",
    "SocketSource",
    "open_link",
]
