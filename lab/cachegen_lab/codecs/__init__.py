"""Research codecs: the baselines and published methods that cachegen is measured against
(``int8-zstd``, ``kivi2``, ``kvtc``, ``turboquant``) and peer systems' codecs run through
their own code (``lmcache-cachegen``: LMCache's CacheGen, third_party/lmcache/README.md), never
used by the connector, store or stream.

Each is registered with :func:`cachegen.codec.api.register_codec` through the
``cachegen.codecs`` entry points (pyproject.toml), loaded the first time a codec name or
bitstream codec id is not one of the core's; then ``get_codec``, ``decode``, ``inspect`` and
the CLI use them like any other.
"""
