"""Research codecs: the baselines and published methods that cachegen is measured against
(``int8-zstd``, ``kivi2``, ``kvtc``, ``turboquant``) and peer systems' codecs run through
their own code (:data:`PEER_CODECS`), never used by the connector, store or stream.

The peers are LMCache's (``lmcache==0.5.6``, third_party/lmcache/README.md), each a frame per
LMCache chunk holding what LMCache itself would store for it:

* ``lmcache-cachegen`` (``lmcache_peer``): LMCache's CacheGen, its CPU path;
* ``lmcache-fp8`` and ``lmcache-asym-k16-v8`` (``lmcache_serdes``): the v1 distributed serdes
  that run on the CPU, every element cast to fp8, and keys kept in the KV's dtype with
  values in fp8. LMCache's TurboQuant serde needs CUDA, so it has no codec here.

Each is registered with :func:`cachegen.codec.api.register_codec` through the
``cachegen.codecs`` entry points (pyproject.toml), loaded the first time a codec name or
bitstream codec id is not one of the core's; then ``get_codec``, ``decode``, ``inspect`` and
the CLI use them like any other.
"""

# the peer systems' codecs, measured beside cachegen by codec-report and the micro-benchmarks
PEER_CODECS = ("lmcache-cachegen", "lmcache-fp8", "lmcache-asym-k16-v8")
