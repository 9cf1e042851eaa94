"""Typed errors shared across the library.

Every error a user can cause derives from ``CacheGenError`` so the CLI can turn it into a
one-line message and a non-zero exit instead of a traceback.
"""


class CacheGenError(Exception):
    """Base class for errors caused by input, configuration or the environment."""


class ModelError(CacheGenError):
    """A model name cannot be resolved, downloaded, converted or loaded."""


class KVError(CacheGenError):
    """A KV cache file is missing, corrupt, truncated or belongs to another model."""


class InputError(CacheGenError):
    """User input is unusable: empty text, text longer than the model allows, bad flag."""
