"""The connector's store seen from outside the engine that writes it: what a
``ConnectorEngine`` (in this process) and an ``OpenAIServer`` both offer, with the same keys
and codecs as the connector, to count and wait for what it saved."""

from __future__ import annotations

import time
from collections.abc import Sequence

from cachegen.connector.config import ConnectorConfig
from cachegen.models import ModelSpec
from cachegen.store.keys import key_scope

POLL_S = 0.05


class StoreClient:
    """Mixin of the lab's engines. The class says who writes the store (``WRITER``, in
    errors), what it raises (``ERROR``) and how long a wait lasts by default; an instance
    holds ``config`` (None: it runs without the connector), ``spec`` and ``_transport``."""

    WRITER: str
    ERROR: type[Exception]
    SAVE_TIMEOUT_S: float

    config: ConnectorConfig | None
    spec: ModelSpec
    _transport = None

    @property
    def transport(self):
        """A client-side view of the store (the connector's keys and codecs)."""
        if self.config is None:
            raise self.ERROR(f"{self.WRITER} runs without the connector (mode recompute)")
        if self._transport is None:
            from cachegen.connector.connector import served_model
            from cachegen.connector.transport import ChunkTransport

            spec = served_model(str(self.spec.path))
            self._transport = ChunkTransport(self.config, spec, spec.identity())
        return self._transport

    def wait_stored(
        self,
        prompt_token_ids: Sequence[int],
        timeout_s: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Block until every whole chunk of the prompt is stored in every save mode, as the
        connector's own save check sees it (under the key scope of ``cache_salt`` and the
        tenant); ``timeout_s`` defaults to the class's ``SAVE_TIMEOUT_S``."""
        timeout_s = self.SAVE_TIMEOUT_S if timeout_s is None else timeout_s
        transport = self.transport
        ids = list(prompt_token_ids)
        want = len(ids) // self.config.chunk_tokens
        salt = key_scope(self.config.tenant, cache_salt)
        deadline = time.monotonic() + timeout_s
        while transport.saved_chunks(ids, self.config.save_modes, salt) < want:
            self._check_writer()
            if time.monotonic() > deadline:
                raise self.ERROR(
                    f"{self.WRITER} did not store {want} chunks within {timeout_s:.0f} s"
                )
            time.sleep(POLL_S)

    def _check_writer(self) -> None:
        """Raise when the writer stopped (a writer in this process cannot have)."""

    def _close_transport(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
