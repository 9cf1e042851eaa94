"""The loader's chunk fixtures (tests/stream/chunks_support.py)."""

from tests.stream.chunks_support import chunks, local_store  # noqa: F401
