"""``cachegen fleet-bench``: N vLLM OpenAI-compatible servers sharing one chunk store, a
client-side router, seeded workloads and a record per request (docs/fleet.md).

``workloads`` generates the requests offline from held-out text; ``configs`` names what each
server of a configuration runs, ``lmcache`` what LMCache's own connector needs (a GPU machine);
``router`` picks a server per request; ``client`` sends one streamed request and times it;
``drive`` sends a run's requests and fails over around a stopped server; ``run`` starts the
fleet, runs it at each link rate and summarizes; ``summary`` holds the records, summaries and
versioned document; ``plots`` draws a document's figures (``cachegen plot``).
"""
