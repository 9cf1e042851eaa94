"""The lab's peer codecs as modes: codecs of one form, registered through the
``cachegen.codecs`` entry points, that the lab's engines store and load and its bench measures
beside cachegen's own modes.

Importing the lab (``cachegen_lab``) joins them to the modes of ``cachegen.modes``
(``join_codec``) in every lab process: the bench and its tools, a lab engine's connector, the
link's chunk server. A server, which never imports the lab, does not know them.
"""

from __future__ import annotations

from cachegen.modes import join_codec

# LMCache's own CacheGen (cachegen_lab.codecs.lmcache_peer): compared with ours through vLLM
LMCACHE_CACHEGEN = "lmcache-cachegen"
PEER_MODES = (LMCACHE_CACHEGEN,)
PEER_NAMES = {LMCACHE_CACHEGEN: "LMCache's CacheGen"}  # their names in reports

for _peer in PEER_MODES:
    join_codec(_peer)
