"""The ``lmcache`` configuration of ``cachegen fleet-bench`` without servers: the command line
and environment its servers get on a GPU machine (the device check answered through its
parameter), what LMCache and redis-py make of that environment, its setup in the document,
its refusals, and the other configurations unchanged."""

from __future__ import annotations

import contextlib
import json

import pytest

from cachegen.errors import InputError
from cachegen_lab.fleet import configs, lmcache, summary
from tests.lab.fleet.document_support import SETTINGS, setup

STORE = "redis://127.0.0.1:6379/0?ttl_s=600&prefix=fleet"
SETTINGS_ENV = {
    "LMCACHE_CHUNK_SIZE": "256",
    "LMCACHE_LOCAL_CPU": "True",
    "LMCACHE_MAX_LOCAL_CPU_SIZE": "5",
    "LMCACHE_REMOTE_SERDE": "cachegen",
}


def _servers(monkeypatch, store: str) -> list:
    """Two servers of the ``lmcache`` fleet, built as fleet-bench builds them, not started."""
    from cachegen_lab.bench.openai_server import OpenAIServer
    from cachegen_lab.fleet.run import server_args, start_fleet

    monkeypatch.setattr(OpenAIServer, "start", lambda self: self)
    with contextlib.ExitStack() as stack:
        return start_fleet(
            stack,
            "tiny-llama",
            configs.config(lmcache.LMCACHE, "tiny-llama"),
            2,
            store=store,
            store_extra={},
            max_model_len=1024,
            env={"VLLM_CPU_KVCACHE_SPACE": "1"},
            server_args=server_args(40),
            log_dir=None,
        )


def test_lmcache_servers_run_lmcaches_connector_set_by_its_environment(monkeypatch):
    lmcache.check(["raw", lmcache.LMCACHE], STORE, cuda=True)  # a GPU machine
    for server in _servers(monkeypatch, STORE):
        command = server.command()
        at = command.index("--kv-transfer-config")
        assert json.loads(command[at + 1]) == {
            "kv_connector": "LMCacheConnectorV1",
            "kv_role": "kv_both",
        }
        assert command.count("--kv-transfer-config") == 1  # none of ours
        assert "--enable-prefix-caching" in command
        assert command[-4:-2] == ["--num-gpu-blocks-override", "40"]  # the bench's own too
        assert server.extra is None  # no connector of ours, no store of ours
        lmcache_env = {k: v for k, v in server.env.items() if k.startswith("LMCACHE_")}
        # Our store's own options (ttl_s, prefix) are not LMCache's: redis-py would refuse them.
        assert lmcache_env == {**SETTINGS_ENV, "LMCACHE_REMOTE_URL": "redis://127.0.0.1:6379/0"}
        assert server.env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_lmcache_reads_the_environment_as_the_fleet_means_it(monkeypatch):
    from lmcache.v1.config import LMCacheEngineConfig

    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    for name, value in lmcache.environment(STORE).items():
        monkeypatch.setenv(name, value)
    config = LMCacheEngineConfig.from_env()
    assert (config.chunk_size, config.local_cpu, config.max_local_cpu_size) == (256, True, 5.0)
    assert (config.remote_url, config.remote_serde) == ("redis://127.0.0.1:6379/0", "cachegen")


def test_a_redis_password_reaches_lmcache_through_the_environment_only(monkeypatch):
    from redis.connection import parse_url

    monkeypatch.setenv("FLEET_LMCACHE_PASSWORD", "pa:ss/w@rd")
    store = "rediss://fleet@redis.example:6380/2?password_env=FLEET_LMCACHE_PASSWORD&ssl_ca_certs=/ca.pem"
    lmcache.check([lmcache.LMCACHE], store, cuda=True)
    servers = _servers(monkeypatch, store)
    env = servers[0].env
    assert parse_url(env["LMCACHE_REMOTE_URL"]) == {
        "username": "fleet",
        "password": "pa:ss/w@rd",
        "host": "redis.example",
        "port": 6380,
        "db": 2,
        "ssl_ca_certs": "/ca.pem",
        "connection_class": parse_url("rediss://h")["connection_class"],
    }
    assert env["LMCACHE_LOG_LEVEL"] == "WARNING"  # LMCache's INFO lines echo the URL
    for server in servers:
        assert "pa:ss/w@rd" not in " ".join(server.command())
    assert "pa:ss/w@rd" not in json.dumps(configs.config(lmcache.LMCACHE, "m").describe())


def test_the_lmcache_setup_names_lmcaches_connector_and_settings_and_validates():
    described = configs.config(lmcache.LMCACHE, "tiny-llama").describe()
    assert described == {
        "config": "lmcache",
        "mode": "recompute",
        "prefix_caching": True,
        "connector": False,  # none of ours: no link rate, no report, no census
        "connector_extra": {},
        "kv_transfer_config": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
        "lmcache_env": SETTINGS_ENV,
    }
    run = {
        "config": "lmcache",
        "bandwidth_mbps": None,
        "setup": {**setup("lmcache", False), **described, "store": STORE},
        "summary": summary.summarize([], 2, connector=False),
        "stops": [],
        "records": [],
        "store": None,
    }
    summary.validate(summary.document(SETTINGS, [run]))
    assert "| lmcache | - | 0 |" in summary.markdown(summary.document(SETTINGS, [run]))


def test_an_lmcache_run_tags_its_requests_with_its_salt_and_nothing_of_ours():
    from cachegen_lab.fleet.drive import Run

    run = Run("lmcache", None, "fleet-x-lmcache-unlimited", connector=False, lmcache=True)
    assert run.extra_body(False) == {
        "cache_salt": "fleet-x-lmcache-unlimited",
        "kv_transfer_params": {"lmcache.tag.cache_salt": "fleet-x-lmcache-unlimited"},
    }
    assert run.label == "lmcache"


def test_lmcache_is_refused_at_once_without_cuda_through_the_command(monkeypatch, capsys):
    from cachegen.cli import main
    from cachegen_lab.fleet import run as fleet_run

    started: list = []
    monkeypatch.setattr(lmcache, "cuda_present", lambda: False)  # this machine's answer, fixed
    monkeypatch.setattr(fleet_run, "start_fleet", lambda *a, **k: started.append(a))
    command = ["fleet-bench", "--model", "tiny-llama", "--configs", "raw", "lmcache"]
    assert main([*command, "--store", STORE]) == 1
    assert started == []  # not even raw's servers
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "cachegen fleet-bench: error: --configs lmcache: LMCache 0.5.6's connector needs "
        "vLLM's CUDA build, and this machine has no CUDA (on vLLM's CPU build it logs "
        "'RuntimeError: No supported cpu connector found.' and recomputes every prompt: "
        "docs/connector/lmcache-on-cpu.md); run it on a GPU machine with vLLM's CUDA build "
        "and LMCache installed with its dependencies (third_party/lmcache/README.md), or "
        "leave lmcache out of --configs"
    )


@pytest.mark.parametrize(
    "store", [None, "file:///tmp/chunks", "local-cluster", "redis+cluster://127.0.0.1:7000"]
)
def test_lmcache_on_a_gpu_still_needs_a_redis_store(store):
    with pytest.raises(InputError, match=r"give --store redis://HOST:PORT/DB or rediss://"):
        lmcache.check([lmcache.LMCACHE], store, cuda=True)


def test_without_lmcache_nothing_is_checked_and_the_other_configurations_are_unchanged():
    from cachegen.cli import build_parser

    lmcache.check(list(configs.DEFAULT_CONFIGS), None, cuda=False)
    assert build_parser().parse_args(["fleet-bench"]).configs == [
        "prefix-cache", "recompute", "raw", "int8", "default", "adaptive",
    ]  # fmt: skip
    for name in ("prefix-cache", "recompute", "raw", "int8", "adaptive"):
        config = configs.config(name, "tiny-llama")
        assert config.server_args() == () and config.server_env(STORE) == {}
        assert set(config.describe()) == {
            "config", "mode", "prefix_caching", "connector", "connector_extra",
        }  # fmt: skip
    assert configs.config("raw", "tiny-llama").describe() == {
        "config": "raw",
        "mode": "raw",
        "prefix_caching": True,
        "connector": True,
        "connector_extra": {},
    }
