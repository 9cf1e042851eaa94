"""Pipelined loading: fetch chunk i+1 while chunk i decodes, deliver chunks in order.

    stats = stream_load(source, records, decode, consume)                   # as addressed
    stats = stream_load(source, records, decode, consume, controller=ctrl)  # adaptive

``records`` are the chunks' ``cachegen.store.RecordAddress`` values, in order. A controller
chooses per chunk: a level of the chunk's codec (``AdaptiveController``: the record of that
level, coded) or a stored form with records of its own (``FastestController``; ``records``
then only give the chunk count and name the chunks in errors).

A fetch thread requests chunks and receives them over the source's connection; the calling
thread decodes each chunk and calls ``consume(index, decoded)`` in order. At most
``max_buffered`` received-but-undecoded chunks wait between the two, so memory stays
bounded by a few chunks whatever the context length; when the decoder falls behind, the
fetcher stops reading and TCP flow control pushes back to the server.

Without a controller every request is sent up front (pipelined on one connection). With a
controller, chunk i+1's level is chosen while chunk i is arriving, once ``lookahead`` of it
has arrived, from the throughput measured on it, so the link never idles for a decision.

Any failure (missing or corrupt chunk, store down, stalled socket, deadline) raises a typed
``CacheGenError`` subclass within ``stall_timeout_s`` (or the deadline) with ``.stats``
attached: ``stats.n_loaded`` leading chunks were consumed and the rest must be recomputed.
Nothing partial is ever passed to ``decode``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Generic, TypeVar

from cachegen.errors import CacheGenError, InputError
from cachegen.store.address import RecordAddress
from cachegen.stream.controller import RECOMPUTE, AdaptiveController, FastestController
from cachegen.stream.errors import StreamError
from cachegen.stream.source import DEFAULT_STALL_TIMEOUT_S, ChunkSource

T = TypeVar("T")
Controller = AdaptiveController | FastestController
_END = object()


@dataclass
class ChunkStat:
    index: int
    form: str  # the name of the form it was loaded in
    bytes: int
    transfer_s: float  # from when the link could start on it to its last byte
    decode_s: float
    consume_s: float


@dataclass
class LoadStats:
    """Measurements of one load. Times in seconds, sizes in bytes of chunk payload."""

    n_chunks: int
    n_loaded: int = 0
    recompute_from: int | None = None  # first chunk left to recomputation (None: all loaded)
    # per chunk: the name of the form it was loaded in, "recompute", or None (not reached)
    forms: list = field(default_factory=list)
    bytes: int = 0
    transfer_s: float = 0.0  # first request to last byte received
    decode_s: float = 0.0  # sum of decode times
    consume_s: float = 0.0  # sum of consumer callback times
    wait_bytes_s: float = 0.0  # decoder idle, waiting for bytes
    wait_decoder_s: float = 0.0  # fetcher idle, waiting for the decoder (buffer full)
    load_s: float = 0.0  # first request to last chunk consumed
    chunks: list[ChunkStat] = field(default_factory=list)
    decisions: list = field(default_factory=list)

    @property
    def goodput_mbps(self) -> float:
        return self.bytes * 8 / self.transfer_s / 1e6 if self.transfer_s > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["goodput_mbps"] = self.goodput_mbps
        return out


def stream_load(
    source: ChunkSource,
    records: Sequence[RecordAddress],
    decode: Callable[[bytes], T],
    consume: Callable[[int, T], None],
    *,
    controller: Controller | None = None,
    chunk_tokens: Sequence[int] | None = None,
    max_buffered: int = 2,
    lookahead: float = 0.5,
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    timeout_s: float | None = None,
) -> LoadStats:
    """Load ``records`` in order; see the module docstring.

    ``controller`` (optional) chooses each chunk's form.
    ``chunk_tokens`` (optional): tokens per chunk, checked against the records and controller.
    ``timeout_s``: deadline for the whole load; ``stall_timeout_s``: longest silence.
    """
    if max_buffered < 1 or not 0 < lookahead <= 1:
        raise InputError("max_buffered must be >= 1 and lookahead in (0, 1]")
    n = len(records)
    if controller is not None and controller.n != n:
        raise InputError(f"controller was built for {controller.n} chunks, got {n} records")
    if chunk_tokens is not None and (
        len(chunk_tokens) != n
        or (controller is not None and list(chunk_tokens) != controller.tokens)
    ):
        raise InputError(
            "chunk_tokens must give one count per record, the same as the controller's"
        )
    pipeline = _Pipeline(
        source, records, controller, max_buffered, lookahead, stall_timeout_s, timeout_s
    )
    return pipeline.run(decode, consume)


class _Pipeline(Generic[T]):
    def __init__(self, source, records, controller, max_buffered, lookahead, stall_s, timeout_s):
        self.source, self.records, self.controller = source, list(records), controller
        self.lookahead, self.stall_s, self.timeout_s = lookahead, stall_s, timeout_s
        self.buffer: queue.Queue = queue.Queue(maxsize=max_buffered)
        self.stop = threading.Event()
        self.stats = LoadStats(n_chunks=len(self.records), forms=[None] * len(self.records))
        self.t0 = 0.0
        self.conn = None

    # ---- fetch thread ----------------------------------------------------------------

    def _choose(self, index: int, inflight_bytes: int) -> bool:
        """Decide chunk ``index`` and request it; False when it goes to recomputation."""
        address = self.records[index]
        if self.controller is not None:
            choice = self.controller.choose(index, time.monotonic() - self.t0, inflight_bytes)
            if choice == RECOMPUTE:
                self.stats.recompute_from = index
                for j in range(index, len(self.records)):
                    self.stats.forms[j] = RECOMPUTE
                return False
            address = self.controller.record(index, choice, address)
        self.stats.forms[index] = address.form.label
        self.conn.request(address)
        return True

    def _fetch(self) -> None:
        try:
            deadline = self.t0 + self.timeout_s if self.timeout_s is not None else None
            self.conn = self.source.open(stall_timeout_s=self.stall_s, deadline=deadline)
            n = len(self.records)
            if self.controller is None:
                for i in range(n):
                    self._choose(i, 0)
                requested = n
            else:
                requested = 1 if n and self._choose(0, 0) else 0
            prev_end = self.t0
            i = 0
            # After the fetcher waited for the decoder, the next chunk's bytes come from socket
            # buffers at memory speed: they measure the host, not the link.
            waited = False
            while i < requested and not self.stop.is_set():
                measure = self.controller is not None and not waited
                midway = (
                    _Midway(self, i + 1, measure)
                    if self.controller is not None and i + 1 < n
                    else None
                )
                chunk = self.conn.receive(midway)
                transfer_s = chunk.t_last - max(prev_end, chunk.t_request)
                prev_end = chunk.t_last
                if measure:
                    self.controller.observe_throughput(chunk.nbytes, transfer_s, i)
                if midway is not None:
                    if not midway.decided:  # chunk too small to decide midway
                        midway.decide(0)
                    requested += midway.requested
                self.stats.transfer_s = chunk.t_last - self.t0
                waited = self._hand_over((i, chunk, transfer_s))
                i += 1
            self._hand_over(_END)
        except BaseException as exc:  # everything reaches the caller's thread
            self._hand_over(exc)
        finally:
            if self.conn is not None:
                self.conn.close()

    def _hand_over(self, item) -> bool:
        """Queue ``item`` for the decoder; True when the buffer was full (the fetcher waited)."""
        t = time.monotonic()
        waited = self.buffer.full()
        while not self.stop.is_set():
            try:
                self.buffer.put(item, timeout=0.05)
                break
            except queue.Full:
                continue
        self.stats.wait_decoder_s += time.monotonic() - t
        return waited

    # ---- caller's thread -------------------------------------------------------------

    def run(self, decode: Callable[[bytes], T], consume: Callable[[int, T], None]) -> LoadStats:
        stats = self.stats
        self.t0 = time.monotonic()
        fetcher = threading.Thread(target=self._fetch, name="cachegen-fetch", daemon=True)
        fetcher.start()
        try:
            while True:
                t = time.monotonic()
                item = self.buffer.get()
                stats.wait_bytes_s += time.monotonic() - t
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                index, chunk, transfer_s = item
                t = time.monotonic()
                decoded = decode(chunk.payload)
                decode_s = time.monotonic() - t
                if self.controller is not None:
                    self.controller.observe_decode(index, decode_s)
                t = time.monotonic()
                consume(index, decoded)
                consume_s = time.monotonic() - t
                stats.chunks.append(
                    ChunkStat(
                        index,
                        chunk.address.form.label,
                        chunk.nbytes,
                        transfer_s,
                        decode_s,
                        consume_s,
                    )
                )
                stats.n_loaded += 1
                stats.bytes += chunk.nbytes
                stats.decode_s += decode_s
                stats.consume_s += consume_s
                del chunk, decoded
        except BaseException as exc:
            self._abort(fetcher)
            stats.load_s = time.monotonic() - self.t0
            if isinstance(exc, CacheGenError):
                exc.stats = stats
                exc.chunk_index = stats.n_loaded
            raise
        fetcher.join()
        stats.load_s = time.monotonic() - self.t0
        if self.controller is not None:
            stats.decisions = [d.to_dict() for d in self.controller.decisions]
        return stats

    def _abort(self, fetcher: threading.Thread) -> None:
        self.stop.set()
        if self.conn is not None:
            self.conn.close()  # unblocks a fetcher waiting on the socket
        fetcher.join(timeout=self.stall_s + 1)
        if fetcher.is_alive():
            raise StreamError("the fetch thread did not stop after the load was aborted")


class _Midway:
    """Progress callback that decides and requests chunk ``index`` once ``lookahead`` of the
    chunk before it has arrived, using the throughput measured since its first bytes (when
    ``measure``)."""

    def __init__(self, pipeline: _Pipeline, index: int, measure: bool) -> None:
        self.pipeline, self.index, self.measure = pipeline, index, measure
        self.decided = False
        self.requested = False
        self._ref: tuple[float, int] | None = None

    def __call__(self, got: int, total: int) -> None:
        if self.decided:
            return
        now = time.monotonic()
        if self._ref is None:
            self._ref = (now, got)
            return
        if got < self.pipeline.lookahead * total:
            return
        t_ref, got_ref = self._ref
        if self.measure and now > t_ref and got > got_ref:
            self.pipeline.controller.observe_throughput(got - got_ref, now - t_ref, self.index - 1)
        self.decide(total - got)

    def decide(self, inflight_bytes: int) -> None:
        self.decided = True
        self.requested = self.pipeline._choose(self.index, inflight_bytes)
