"""The codec's error type."""

from cachegen.errors import CacheGenError


class CodecError(CacheGenError):
    """A bitstream is corrupt, truncated or unsupported, or a codec is misconfigured."""
