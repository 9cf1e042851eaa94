"""``cachegen fleet-bench``: N vLLM OpenAI-compatible servers sharing one chunk store, a
client-side router, seeded workloads and a record per request (docs/fleet.md).

``workloads`` generates the requests offline from held-out text; ``configs`` names what each
server of a configuration runs; ``router`` picks a server per request; ``client`` sends one
streamed request and times it; ``run`` starts the fleet, drives it and summarizes.
"""
