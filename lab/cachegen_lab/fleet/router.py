"""The client-side router: which server of the fleet gets a request.

``round-robin``
    request i of the workload (its index, the order requests are listed and sent in) goes to
    server i mod N, whoever asks;
``sticky``
    every request of one user or document goes to one server: the k-th user or document (in
    order of first request) to server k mod N.

Both are deterministic for a workload, so two configurations see the same assignment. A
server marked down (stopped mid-run) gets no more requests: its requests go to the next live
server after it (in index order), which is how a load balancer fails over.
"""

from __future__ import annotations

from cachegen_lab.fleet.workloads import Request, Workload

ROUND_ROBIN = "round-robin"
STICKY = "sticky"
ROUTERS = (ROUND_ROBIN, STICKY)


class Router:
    def __init__(self, policy: str, servers: int, workload: Workload) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"unknown router {policy!r}; use one of {', '.join(ROUTERS)}")
        if servers < 1:
            raise ValueError("a fleet has at least one server")
        self.policy = policy
        self.servers = servers
        self._slot = {key: k for k, key in enumerate(workload.keys())}
        self.down: set[int] = set()

    def preferred(self, request: Request) -> int:
        """The server the policy names for ``request``, live or not."""
        if self.policy == ROUND_ROBIN:
            return request.index % self.servers
        return self._slot[request.key] % self.servers

    def server(self, request: Request) -> int:
        """The live server ``request`` goes to."""
        if len(self.down) >= self.servers:
            raise RuntimeError("every server of the fleet is down")
        chosen = self.preferred(request)
        while chosen in self.down:
            chosen = (chosen + 1) % self.servers
        return chosen

    def mark_down(self, server: int) -> None:
        self.down.add(server)

    def any_live(self) -> bool:
        return len(self.down) < self.servers
