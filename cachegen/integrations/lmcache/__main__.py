"""``python -m cachegen.integrations.lmcache ARGS``: ``lmcache ARGS`` with the cachegen serde."""

from cachegen.integrations.lmcache import main

main()
