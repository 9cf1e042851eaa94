"""Tensor parallelism's heads: which heads a rank holds, and the save exchange between real
processes over a real gloo group, where a prompt one rank could not read is stored by none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cachegen.connector.config import RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen.connector.head_shards import HeadShard
from cachegen.models import resolve
from tests.connector.tp_save_rank import CHUNK, TOKENS, prompt_kv
from tests.support import REPO, connector_transport, free_port


@pytest.mark.parametrize(
    ("num_heads", "size", "heads", "owners"),
    [
        (4, 2, [(0, 2), (2, 4)], [0, 1]),
        (2, 2, [(0, 1), (1, 2)], [0, 1]),
        (1, 2, [(0, 1), (0, 1)], [0]),  # one KV head, replicated on both ranks
        (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)], [0, 2]),
    ],
)
def test_each_rank_holds_vllms_heads(num_heads, size, heads, owners):
    shards = [HeadShard(rank, size, num_heads) for rank in range(size)]
    assert [(s.heads.start, s.heads.stop) for s in shards] == heads
    assert shards[0].owners() == owners


def test_a_tp_size_that_does_not_fit_the_heads_is_refused():
    with pytest.raises(ConnectorError, match="tensor_parallel_size=2 .* 3 KV heads"):
        HeadShard(0, 2, 3)


FAILING_RANKS = (-1, 0, 1)  # none, then either rank's read fails


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[int, Path]:
    """The store of one save by two real ranks for each failing rank (one pair of processes
    runs them all, one after another)."""
    root = tmp_path_factory.mktemp("tp-saves")
    stores = {failing: root / f"failing-{failing}" for failing in FAILING_RANKS}
    runs = [f"{(path / 'store').as_uri()}:{failing}" for failing, path in stores.items()]
    port = free_port()
    script = REPO / "tests" / "connector" / "tp_save_rank.py"
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(rank), "2", str(port), *runs], cwd=REPO)
        for rank in range(2)
    ]
    assert [rank.wait(timeout=300) for rank in ranks] == [0, 0]
    return stores


def _stored(path: Path):
    spec = resolve("tiny-llama")
    transport = connector_transport(spec, path, chunk_tokens=CHUNK)
    return transport, prompt_kv(spec)


def test_the_first_rank_stores_every_heads_kv(saved):
    transport, kv = _stored(saved[-1])
    ids = kv.token_ids.tolist()
    options = RequestOptions(mode="raw")
    assert transport.stored_chunks(ids, options) == TOKENS // CHUNK
    loaded = []
    result = transport.load(ids, 0, TOKENS // CHUNK, options, loaded.append)
    assert result.error is None
    keys = torch.cat([chunk.keys for chunk in loaded], dim=2)
    values = torch.cat([chunk.values for chunk in loaded], dim=2)
    assert torch.equal(keys, kv.keys) and torch.equal(values, kv.values)


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_prompt_one_rank_could_not_read_is_stored_by_none(saved, failing_rank):
    transport, kv = _stored(saved[failing_rank])
    assert transport.stored_chunks(kv.token_ids.tolist(), RequestOptions(mode="raw")) == 0
