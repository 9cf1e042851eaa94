"""One-question experiments: each module answers one question the docs quote, and is run by
``cachegen experiment NAME`` (``cachegen experiment --help`` lists them).

``tcq_ablation`` (where tcq's gains come from: its transform or its component weights),
``tcq_redundancy`` (what redundancy tcq leaves in its symbols), ``tcq_layers`` (what one
layered stream per chunk would cost, its prefixes coarser levels), ``packed_fit`` (which
calibrated allocations fit coded + packed), ``stream_sim`` (the adaptive controller over
simulated bandwidth traces, behind ``cachegen stream-bench --controller-eval``), ``window``
(what ``skip_out_of_window`` saves a load) and ``repeat`` (how soon a prefill's chunks are
loadable).
"""
