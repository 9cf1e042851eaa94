"""cachegen: KV-cache compression and streaming for fast LLM serving (CacheGen, SIGCOMM 2024)."""

__version__ = "0.1.0"
