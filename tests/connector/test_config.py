"""Connector options from kv_connector_extra_config and per-request kv_transfer_params."""

from __future__ import annotations

import re

import pytest

from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen.errors import CacheGenError
from cachegen.modes import CODED, Form
from cachegen.profiles import ensure_profile


def test_defaults_and_engine_keys():
    config = ConnectorConfig.from_extra_config(
        {
            "store": "redis://127.0.0.1:1/0",
            "mode": "int8",
            "chunk_tokens": 512,
            "slo_ms": 100,
        }
    )
    assert config.store == "redis://127.0.0.1:1/0"
    assert config.chunk_tokens == 512
    assert config.defaults == RequestOptions(mode="int8", slo_ms=100)
    assert config.save_modes == ("int8",)  # saves what it loads unless told otherwise
    assert ConnectorConfig.from_extra_config(None).store.startswith("file://")


def test_the_default_mode_is_the_models(smollm2, gemma3, tiny_llama, monkeypatch):
    """tcq for a model that ships a tcq calibration with a default level (the embedded models),
    cachegen for one without (the tiny models, any hub model), decided from the shipped files
    without a tcq model file; an explicit mode wins, and each saves what it loads."""
    from cachegen.connector.config import default_mode
    from cachegen.fitting import tcq

    def no_fit(*args, **kwargs):
        raise AssertionError("the default mode is decided without a tcq model file")

    monkeypatch.setattr(tcq, "ensure_tcq_model", no_fit)
    for spec, mode in ((smollm2, "tcq"), (gemma3, "tcq"), (tiny_llama, "cachegen")):
        model = spec.identity()
        config = ConnectorConfig.from_extra_config({"chunk_tokens": 256}, model)
        assert default_mode(model) == config.defaults.mode == mode
        assert config.save_modes == (mode,)
        assert config.defaults.override({"level": 3}).mode == mode  # a request naming none
        assert config.defaults.override({"mode": "int8"}).mode == "int8"
        explicit = ConnectorConfig.from_extra_config({"mode": "cachegen"}, model)
        assert (explicit.defaults.mode, explicit.save_modes) == ("cachegen", ("cachegen",))
        saved = ConnectorConfig.from_extra_config({"save_modes": ["int8"]}, model)
        assert (saved.defaults.mode, saved.save_modes) == (mode, ("int8",))
    assert ConnectorConfig.from_extra_config({}).defaults.mode == "cachegen"  # no model given


def test_a_shipped_calibration_without_a_tcq_default_keeps_cachegen(tmp_path, monkeypatch):
    import json

    from cachegen.codec import shipped
    from cachegen.codec.cachegen.profile import SHIPPED_SCHEMA, SHIPPED_VERSION

    def ship(name: str, tcq: dict | None) -> None:
        doc = {"schema": SHIPPED_SCHEMA, "version": SHIPPED_VERSION, "model": {"fingerprint": name}}
        (tmp_path / f"{name}.json").write_text(json.dumps({**doc, "levels": {}, "tcq": tcq}))

    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path)
    ship("with-default", {"targets": {"24": 1.0}, "default_level": 24})
    ship("without-default", {"targets": {"24": 1.0}, "default_level": None})
    ship("without-tcq", None)
    got = {name: shipped.ships_tcq_default(name) for name in ("with-default", "without-default")}
    got.update({name: shipped.ships_tcq_default(name) for name in ("without-tcq", "unknown")})
    assert got == {
        "with-default": True,
        "without-default": False,
        "without-tcq": False,
        "unknown": False,
    }
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(CacheGenError, match="broken.json is unreadable"):
        shipped.ships_tcq_default("unknown")


def test_request_overrides_engine_defaults():
    config = ConnectorConfig.from_extra_config(
        {"mode": "raw", "slo_ms": 100, "save_modes": ["raw", "int8"]}
    )
    options = config.request_options({"mode": "adaptive", "slo_ms": 500})
    assert (options.mode, options.slo_ms) == ("adaptive", 500)
    assert config.defaults.override(None) is config.defaults
    assert config.save_modes == ("raw", "int8")


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"modee": "raw"}, "unknown kv_connector_extra_config keys"),
        ({"mode": "zip"}, "unknown mode 'zip'"),
        ({"chunk_tokens": 0}, "chunk_tokens must be a positive integer"),
        ({"store": "/tmp/x"}, "store must be a URL"),
        ({"save_modes": "raw"}, "save_modes must be a list"),
        ({"save_modes": ["raw", "gzip"]}, "unknown mode 'gzip' in save_modes"),
        ({"mode": "adaptive"}, "adaptive mode needs slo_ms"),
        ({"bandwidth_mbps": 100}, "unknown kv_connector_extra_config keys"),
        ({"shaper": "token-bucket"}, "unknown kv_connector_extra_config keys"),
        ({"slo_ms": -5}, "slo_ms must be a positive number"),
        ({"level": "2"}, "level must be a level, an integer >= 0"),
        ({"cachegen_levels": 2}, "cachegen_levels must be a non-empty list"),
        ({"cachegen_levels": []}, "cachegen_levels must be a non-empty list"),
        ({"cachegen_levels": [11, 32779]}, "write the form 'cachegen-11-packed' instead"),
        ({"tcq_levels": [22 | 1 << 15]}, "write the form 'tcq-22-packed' instead"),
        ({"cachegen_levels": ["tcq-22"]}, "cachegen_levels: 'tcq-22' is not a form of cachegen"),
        ({"level": 32779}, "write the form 'cachegen-11-packed' instead"),
        ({"max_slo_ms": float("nan")}, "max_slo_ms must be a positive number"),
        ({"load_async": "no"}, "load_async must be true or false"),
    ],
)
def test_bad_engine_config_fails_with_a_clear_message(extra, message):
    with pytest.raises(ConnectorError, match=message):
        ConnectorConfig.from_extra_config(extra)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"levle": 2}, "unknown kv_transfer_params"),
        ({"load": "yes"}, "load must be true or false"),
        ({"bandwidth_mbps": 1.5}, "unknown kv_transfer_params"),  # links are the lab's
        ({"rtt_ms": float("nan")}, "unknown kv_transfer_params"),
        ({"level": float("nan")}, "level must be a level"),
        ({"level": True}, "level must be a level"),
        ({"level": 32779}, "is a store slot, not a level"),
        ({"slo_ms": float("nan")}, "slo_ms must be a positive number"),
        ({"slo_ms": float("inf")}, "slo_ms must be a positive number"),
        ({"slo_ms": "fast"}, "slo_ms must be a positive number"),
        ({"max_loss_pct": float("nan")}, "max_loss_pct must be a number >= 0"),
        ({"form": "cachegen-11-zipped"}, "form: unknown form"),
        ({"form": "cachegen-11-packed", "level": 11}, "names its mode and level: drop them"),
        ("mode=tcq", "kv_transfer_params must be an object"),
    ],
)
def test_bad_request_params_fail_with_a_clear_message(params, message):
    with pytest.raises(ConnectorError, match=message):
        RequestOptions().override(params)


def test_a_request_chooses_only_among_what_the_engine_serves():
    """The engine's modes (its mode, those it saves, adaptive over a leveled codec's forms),
    a time budget within its max_slo_ms, and a stored form by its name."""
    config = ConnectorConfig.from_extra_config(
        {"mode": "int8", "save_modes": ["int8", "cachegen"], "max_slo_ms": 5000}
    )
    assert config.modes == ("int8", "cachegen", "adaptive")
    assert config.request_options({"mode": "adaptive", "slo_ms": 5000}).slo_ms == 5000
    with pytest.raises(ConnectorError, match="above this engine's max_slo_ms"):
        config.request_options({"mode": "adaptive", "slo_ms": 1e300})
    with pytest.raises(ConnectorError, match="mode 'tcq' is not one this engine serves"):
        config.request_options({"mode": "tcq"})
    packed = config.request_options({"form": "cachegen-11-packed"})
    assert (packed.mode, packed.level, packed.form) == ("cachegen", 11, "cachegen-11-packed")
    assert config.request_options({"form": "int8"}).mode == "int8"
    assert config.request_options({"mode": "cachegen", "level": 11}).form is None
    int8_only = ConnectorConfig.from_extra_config({"mode": "int8"})
    assert int8_only.modes == ("int8", "adaptive")
    with pytest.raises(ConnectorError, match="mode 'raw' is not one this engine serves"):
        int8_only.request_options({"mode": "raw"})


def test_the_lab_connector_alone_takes_a_link_per_request():
    from cachegen_lab.connector.options import LabRequestOptions, lab_config

    config, shaper = lab_config({"mode": "raw", "shaper": "netns"})
    assert shaper == "netns" and config.defaults.__class__ is LabRequestOptions
    options = config.request_options({"bandwidth_mbps": 100, "rtt_ms": 5})
    assert (options.bandwidth_mbps, options.rtt_ms) == (100, 5)
    with pytest.raises(ConnectorError, match="bandwidth_mbps must be a positive number"):
        config.request_options({"bandwidth_mbps": float("nan")})
    with pytest.raises(ConnectorError, match="unknown shaper"):
        lab_config({"shaper": "tc"})


def test_chunk_must_align_with_vllm_blocks():
    config = ConnectorConfig.from_extra_config({"chunk_tokens": 200})
    with pytest.raises(ConnectorError, match="multiple of vLLM's block size 128"):
        config.check_block_size(128)
    ConnectorConfig.from_extra_config({"chunk_tokens": 256}).check_block_size(128)


def test_adaptive_chooses_among_the_calibrated_levels(smollm2, tiny_llama, tmp_path):
    """With calibrated levels shipped for the model, adaptive leaves out the paper presets they
    dominate (bytes alone would rank the presets in between), also from an explicit list; by
    default it chooses among the stored save ladder (test_storage.py); a model without
    a calibration offers every stored level."""
    from cachegen.connector.transport import ChunkTransport

    def levels(spec, **extra):
        config = ConnectorConfig.from_extra_config(
            {"store": (tmp_path / "store").as_uri(), **extra}
        )
        transport = ChunkTransport(config, spec, spec.identity())
        try:
            return transport.ladder.adaptive_levels, transport.forms("cachegen")
        finally:
            transport.close()

    calibrated = ensure_profile(smollm2).calibrated_levels()
    assert calibrated and not {1, 2, 3} & set(calibrated)
    adaptive, stored = levels(smollm2)
    coded = [f.level for f in stored if f.packing == CODED]  # the ladder also holds a packed form
    assert adaptive == coded and set(coded) <= set(calibrated)  # the default save ladder
    assert levels(smollm2, cachegen_levels=[2, 4]) == (
        [4],
        [Form("cachegen", 2), Form("cachegen", 4)],
    )
    adaptive, stored = levels(tiny_llama)
    assert all(f.packing == CODED for f in stored)
    levels_ = [f.level for f in stored]
    assert adaptive == levels_ and set(levels_) <= set(ensure_profile(tiny_llama).levels)


def _documented_keys() -> list[set[str]]:
    """The keys of each table in docs/connector.md's "Options" section, in order."""
    import re

    from tests.support import DOCS

    text = (DOCS / "connector.md").read_text()
    section = text.split("### Options\n", 1)[1].split("\n### ", 1)[0]
    tables: list[set[str]] = []
    for block in re.split(r"\n(?!\|)", section):
        rows = [line for line in block.splitlines() if line.startswith("| `")]
        if rows:
            tables.append({k for row in rows for k in re.findall(r"`(\w+)`", row.split(" | ")[0])})
    return tables


def test_the_docs_tables_list_exactly_the_declared_options():
    from cachegen.connector.config import ENGINE, REQUEST, describe_options

    declared = {
        scope: {row["key"] for row in describe_options() if row["scope"] == scope}
        for scope in (ENGINE, REQUEST)
    }
    assert _documented_keys() == [declared[ENGINE], declared[REQUEST]]
    assert all(row["doc"] for row in describe_options())


def test_the_connector_declines_vllms_sleep_mode():
    """vLLM 0.33 on asks a connector before it releases the KV cache for sleep mode; a
    background load may still be writing into it (third_party/vllm/README.md)."""
    from cachegen.connector import CacheGenConnector

    assert CacheGenConnector.supports_sleep_mode(None) is False


def test_pipeline_parallelism_is_refused_before_the_store_opens(tmp_path):
    from vllm.config import KVTransferConfig, ParallelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from cachegen.connector import CacheGenConnector

    store = tmp_path / "store"
    transfer = KVTransferConfig(
        kv_connector="CacheGenConnector",
        kv_connector_module_path="cachegen.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"store": store.as_uri()},
    )
    config = VllmConfig(
        parallel_config=ParallelConfig(pipeline_parallel_size=2), kv_transfer_config=transfer
    )
    with pytest.raises(ConnectorError, match="set pipeline_parallel_size=1"):
        CacheGenConnector(config, KVConnectorRole.SCHEDULER, None)
    assert not store.exists()


def test_an_engine_that_may_serve_tcq_without_its_model_file_refuses_to_start(
    tiny_llama, tmp_path, monkeypatch
):
    """The scheduler's connector, as vLLM builds it at start-up, for the tiny test model, which
    ships no tcq model file: it refuses naming the command, and fits nothing (a server never
    fits or calibrates)."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from cachegen.codec.tcq import model as tcq_model
    from cachegen.connector import CacheGenConnector

    monkeypatch.setenv("CACHEGEN_PROFILE_DIR", str(tmp_path / "profiles"))
    tcq_model.forget_cached_tcq_models()
    transfer = KVTransferConfig(
        kv_connector="CacheGenConnector",
        kv_connector_module_path="cachegen.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"store": (tmp_path / "store").as_uri(), "mode": "tcq"},
    )
    config = SimpleNamespace(
        kv_transfer_config=transfer,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model=str(tiny_llama.path), revision=None),
        load_config=SimpleNamespace(download_dir=None),
        cache_config=SimpleNamespace(block_size=128),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True),
    )
    command = "run `cachegen profile build --model tiny-llama --codec tcq` first"
    with pytest.raises(ConnectorError, match=re.escape(command)):
        CacheGenConnector(config, KVConnectorRole.SCHEDULER, None)
    assert not list((tmp_path / "profiles").rglob("*.cgtq"))  # nothing was fitted
