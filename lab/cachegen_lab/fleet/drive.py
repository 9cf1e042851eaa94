"""Send a workload to a running fleet through the router, fail over around a stopped server,
and record every request.

Requests are sent in the workload's order, at most ``concurrency`` in flight (asyncio, one
client per server). A request waits for the request whose answer its chat ends with
(multi-round QA's closed loop); a failed request's answer is empty text. With a ``Stop``, the
server it names is stopped (SIGTERM, as an operator or an orchestrator stops a replica) once
``after`` requests of the run have ended (answered or failed, so the stop comes at the same
point of every run): the router sends it nothing more, and a
request that fails on it is sent again to the next live server (an attempt in its record).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cachegen.errors import CacheGenError
from cachegen_lab.bench.links import link_label
from cachegen_lab.fleet import client, summary
from cachegen_lab.fleet.lmcache import SALT_TAG
from cachegen_lab.fleet.router import Router
from cachegen_lab.fleet.workloads import Workload

if TYPE_CHECKING:  # imported where used: it loads torch, and `cachegen --help` should not
    from cachegen_lab.bench.openai_server import OpenAIServer

REQUEST_TIMEOUT_S = 1800.0


class FleetError(CacheGenError):
    """A run could not be measured: a warm-up request failed."""


@dataclass(frozen=True)
class Stop:
    """Stop ``server`` once ``after`` requests of the run have ended (answered or failed)."""

    server: int
    after: int


@dataclass(frozen=True)
class Run:
    """One configuration at one link rate: what every request of it carries."""

    config: str
    bandwidth_mbps: float | None
    cache_salt: str
    connector: bool
    lmcache: bool = False  # LMCache's connector: the salt as its request tag

    @property
    def label(self) -> str:
        """``raw at 100`` for the connector, the configuration alone otherwise."""
        if not self.connector:
            return self.config
        return f"{self.config} at {link_label(self.bandwidth_mbps)}"

    def extra_body(self, ignore_eos: bool) -> dict[str, Any]:
        """vLLM's request fields: the run's ``cache_salt`` (so that neither vLLM's prefix
        cache nor the store's keys reuse another run's KV; for LMCache, which keys chunks
        without it, also as its request tag), the link rate for the connector,
        ``ignore_eos``."""
        body: dict[str, Any] = {"cache_salt": self.cache_salt}
        if self.connector and self.bandwidth_mbps is not None:
            body["kv_transfer_params"] = {"bandwidth_mbps": self.bandwidth_mbps}
        if self.lmcache:
            body["kv_transfer_params"] = {SALT_TAG: self.cache_salt}
        if ignore_eos:
            body["ignore_eos"] = True
        return body


@dataclass(frozen=True)
class Sending:
    """How requests are sent."""

    concurrency: int
    max_tokens: int
    api: str
    ignore_eos: bool = False


class Driver:
    """One run's requests on ``servers``: records, and the servers stopped (``stops``)."""

    def __init__(
        self,
        servers: Sequence[OpenAIServer],
        work: Workload,
        router: Router,
        run: Run,
        sending: Sending,
        stop: Stop | None = None,
    ) -> None:
        self.servers, self.work, self.router = servers, work, router
        self.run, self.sending, self.stop = run, sending, stop
        self.stops: list[dict[str, Any]] = []
        self._ended = 0
        self._halts: list[asyncio.Future] = []

    async def records(self) -> list[dict[str, Any]]:
        self._clients = [s.async_client(timeout=REQUEST_TIMEOUT_S) for s in self.servers]
        loop = asyncio.get_running_loop()
        self._done = {r.index: loop.create_future() for r in self.work.requests}
        self._turns: dict[int, list[dict[str, str]]] = {}
        self._gate = asyncio.Semaphore(self.sending.concurrency)
        self._start = time.perf_counter()
        try:
            out = list(await asyncio.gather(*(self._one(r) for r in self.work.requests)))
            await asyncio.gather(*self._halts)
            return out
        finally:
            for c in self._clients:
                await c.close()

    async def _one(self, request) -> dict[str, Any]:
        history: list[dict[str, str]] = []
        if request.after is not None:
            await self._done[request.after]
            history = self._turns[request.after]
        async with self._gate:
            index, attempts, answer = await self._send(request, request.messages(history))
        self._turns[request.index] = [
            *history,
            {"role": "user", "content": request.user},
            {"role": "assistant", "content": answer.text},
        ]
        self._count_end()  # before the waiters wake: none of them is sent to a stopped server
        self._done[request.index].set_result(None)
        run = (self.run.config, self.run.bandwidth_mbps)
        return summary.record(
            run,
            self.work.name,
            request,
            answer,
            self._start,
            routed=self.router.preferred(request),
            server=index,
            attempts=attempts,
        )

    async def _send(self, request, messages):
        """Send to the router's server; while it failed on a server that is down, again to
        the next live one. ``(server, failed attempts, answer)``; times from the first try."""
        s = self.sending
        body = self.run.extra_body(s.ignore_eos)
        attempts: list[dict[str, Any]] = []
        index = self.router.server(request)
        first = None
        while True:
            answer = await client.send(
                self._clients[index], self.servers[index].model, messages, s.max_tokens,
                s.api, body,
            )  # fmt: skip
            first = answer.sent if first is None else first
            answer.sent = first
            if answer.error is None or index not in self.router.down or not self.router.any_live():
                return index, attempts, answer
            attempts.append({"server": index, "error": answer.error})
            index = self.router.server(request)

    def _count_end(self) -> None:
        """Count a request that ended, answered or failed; at the stop's count, mark its
        server down and stop it."""
        self._ended += 1
        if self.stop is None or self._ended != self.stop.after:
            return
        server = self.stop.server
        self.router.mark_down(server)
        self.stops.append({"server": server, "at_s": time.perf_counter() - self._start})
        closing = asyncio.get_running_loop().run_in_executor(None, self.servers[server].close)
        self._halts.append(closing)  # SIGTERM, then what is left of its process group


async def warm_up(servers: Sequence[OpenAIServer], work: Workload, sending: Sending, run: Run):
    """Before a run's requests: the workload's first chat, under a salt of its own (no run
    reuses it), sent to every server in turn, twice, starting from another server the second
    time, so that each server has prefilled, stored and (with the connector) loaded once, and
    no run pays a first request's costs (kernels loaded, buffers sized). Nothing is recorded;
    a failed request raises ``FleetError``."""
    request = work.requests[0]
    body = dataclasses.replace(run, cache_salt=f"{run.cache_salt}-warm-up").extra_body(True)
    clients = [s.async_client(timeout=REQUEST_TIMEOUT_S) for s in servers]
    try:
        for start in (0, 1):
            for k in range(len(servers)):
                i = (start + k) % len(servers)
                answer = await client.send(
                    clients[i], servers[i].model, request.messages([]), 2, sending.api, body
                )
                if answer.error is not None:
                    raise FleetError(
                        f"{run.label}: the warm-up request on server {i} failed: {answer.error}"
                    )
            body = {**body, "cache_salt": body["cache_salt"] + "-again"}
    finally:
        for c in clients:
            await c.close()
