"""Errors of the vLLM connector."""

from cachegen.errors import CacheGenError


class ConnectorError(CacheGenError):
    """The connector cannot run with this configuration, backend or KV layout."""
