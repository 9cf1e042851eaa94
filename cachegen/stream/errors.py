"""Typed streaming errors. Like store errors, each one means "recompute these tokens"."""

from cachegen.errors import CacheGenError


class StreamError(CacheGenError):
    """Base class for failures while moving chunks over a link."""


class StreamTimeout(StreamError):
    """No bytes arrived for ``stall_timeout_s``, or the whole load overran its deadline."""


class StreamProtocolError(StreamError):
    """The peer sent bytes that are not a valid frame of the chunk protocol."""
