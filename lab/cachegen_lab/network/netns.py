"""Kernel traffic shaping: a private network namespace whose loopback has a ``tbf`` qdisc.

Linux and root only. ``NetnsShaper`` creates the namespace ``cachegen-<pid>-<random>``,
brings its loopback up and attaches ``tc qdisc ... tbf rate <R>mbit``; round-trip time is
added with ``netem`` when the kernel has it. Sockets are made inside the namespace from a
short-lived thread that joins it with ``setns(2)`` (the rest of the process stays where it
is), so the chunk server and the loader run in this process and their loopback traffic
crosses the shaped device. The namespace is deleted on exit, and namespaces left behind by
dead processes are removed by ``cleanup_stale()``.
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from cachegen.stream.errors import StreamError

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/var/run/netns")
QUEUE_BYTES = 8 * 1024 * 1024
TBF_BURST_S = 0.004
SEND_BUFFER_MAX = 32 * 1024 * 1024
NAME_RE = re.compile(r"^cachegen-(\d+)-[0-9a-f]{8}\Z")
T = TypeVar("T")


class ShaperUnavailable(StreamError):
    """The requested traffic shaper cannot run here (e.g. netns mode without root or tc)."""


def unavailable_reason() -> str | None:
    """Why netns shaping cannot run here, or None if it can."""
    if not os.uname().sysname == "Linux":
        return "netns shaping needs Linux"
    if os.geteuid() != 0:
        return "netns shaping needs root (creating network namespaces and tc qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"netns shaping needs `{tool}` (apt-get install -y iproute2)"
    return None


def _run(*cmd: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ShaperUnavailable(
            f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.returncode}"
        )
    return proc


def cleanup_stale() -> list[str]:
    """Delete namespaces this library made in processes that no longer exist."""
    removed = []
    if not NETNS_DIR.is_dir():
        return removed
    for entry in NETNS_DIR.iterdir():
        m = NAME_RE.match(entry.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            if (
                subprocess.run(["ip", "netns", "del", entry.name], capture_output=True).returncode
                == 0
            ):
                removed.append(entry.name)
    return removed


class NetnsShaper:
    """Context manager: a shaped namespace and a factory for sockets inside it."""

    def __init__(
        self, rate_mbps: float, *, rtt_ms: float = 0.0, burst_bytes: int | None = None
    ) -> None:
        if rate_mbps <= 0:
            raise ShaperUnavailable(f"rate must be positive, got {rate_mbps} Mbit/s")
        self.rate_mbps = rate_mbps
        self.rtt_ms = rtt_ms
        # tbf needs a bucket of at least one packet (loopback MTU is 64 KiB) and, unlike the
        # token bucket, cannot catch up after the receiver stalled: 4 ms of traffic, >= 4 packets.
        self.burst_bytes = burst_bytes or max(4 * 65536, int(rate_mbps * 1e6 / 8 * TBF_BURST_S))
        self.name = f"cachegen-{os.getpid()}-{secrets.token_hex(4)}"
        self.kernel_rtt = False  # whether netem adds the RTT (else the caller must)
        self._created = False

    def __enter__(self) -> NetnsShaper:
        reason = unavailable_reason()
        if reason:
            raise ShaperUnavailable(reason)
        cleanup_stale()
        _run("ip", "netns", "add", self.name)
        self._created = True
        try:
            _run("ip", "-n", self.name, "link", "set", "lo", "up")
            # Deep send buffers in the namespace (its own sysctl; the host is untouched): the
            # kernel keeps the shaped link busy while a descheduled sender is away.
            _run(
                "ip",
                "netns",
                "exec",
                self.name,
                "sysctl",
                "-q",
                "-w",
                f"net.ipv4.tcp_wmem=4096 16384 {SEND_BUFFER_MAX}",
            )
            # A deep queue (8 MiB): TCP on loopback can have megabytes in flight, and a tail drop
            # there costs a 200 ms retransmission timeout that would distort the goodput.
            tbf = f"tbf rate {self.rate_mbps}mbit burst {self.burst_bytes} limit {QUEUE_BYTES}"
            if self.rtt_ms > 0 and self._try_netem():
                _run(*self._add_qdisc(f"parent 1:1 handle 10: {tbf}"))
            else:
                _run(*self._add_qdisc(f"root handle 1: {tbf}"))
        except BaseException:
            self.close()
            raise
        return self

    def _try_netem(self) -> bool:
        # Loopback packets cross the device once per direction: delay each by half the RTT.
        cmd = self._add_qdisc(f"root handle 1: netem delay {self.rtt_ms / 2}ms")
        self.kernel_rtt = subprocess.run(cmd, capture_output=True).returncode == 0
        return self.kernel_rtt

    def _add_qdisc(self, spec: str) -> list[str]:
        """The ``tc`` command that adds the queueing discipline ``spec`` to the namespace's
        loopback (``spec`` is space-separated words)."""
        return ["tc", "-n", self.name, "qdisc", "add", "dev", "lo", *spec.split()]

    def close(self) -> None:
        if self._created:
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
            self._created = False

    def __exit__(self, *exc) -> None:
        self.close()

    def qdisc(self) -> str:
        return _run("tc", "-n", self.name, "qdisc", "show", "dev", "lo").stdout.strip()

    def socket(self) -> socket.socket:
        """A TCP socket in the namespace (pass as ``socket_factory``)."""
        return socket_in(self.name)


def run_inside(name: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on a thread that has joined namespace ``name`` (sockets it makes stay there)."""
    result: dict = {}

    def target() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            target_fd = os.open(NETNS_DIR / name, os.O_RDONLY)
        except OSError as exc:
            os.close(home)
            result["error"] = ShaperUnavailable(f"network namespace {name} does not exist: {exc}")
            return
        try:
            if libc.setns(target_fd, CLONE_NEWNET) != 0:
                raise ShaperUnavailable(
                    f"setns into {name} failed: {os.strerror(ctypes.get_errno())}"
                )
            try:
                result["value"] = fn()
            finally:
                libc.setns(home, CLONE_NEWNET)
        except BaseException as exc:
            result["error"] = exc
        finally:
            os.close(target_fd)
            os.close(home)

    thread = threading.Thread(target=target, name="cachegen-netns")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def socket_in(name: str) -> socket.socket:
    """A TCP socket created inside network namespace ``name``."""
    return run_inside(name, lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
