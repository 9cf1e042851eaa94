"""The codec registry: the core codecs built in, the others registered through the
``cachegen.codecs`` entry points when first asked for, their stream ids reserved."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cachegen.codec import CodecError, api, decode, get_codec
from cachegen.codec.baselines import Int8Codec


@pytest.fixture
def kivi2_blob(kv) -> bytes:
    return get_codec("kivi2").encode(kv.slice(0, 20))


@pytest.fixture
def core_only(kivi2_blob, monkeypatch):
    """The registry as if no plugin were installed (after ``kivi2_blob`` was encoded)."""
    core = {n: c for n, c in api._CODECS.items() if c.__module__.startswith("cachegen.codec.")}
    monkeypatch.setattr(api, "_CODECS", core)
    monkeypatch.setattr(api, "_CODECS_BY_ID", {c.codec_id: c for c in core.values()})
    monkeypatch.setattr(api, "_plugin_errors", {})


def test_the_lab_is_imported_only_for_a_codec_outside_the_core():
    probe = (
        "import sys\n"
        "from cachegen.codec import get_codec\n"
        "get_codec('int8'), get_codec('cachegen')\n"
        "assert not [m for m in sys.modules if m.startswith('cachegen_lab')]\n"
        "print(type(get_codec('kvtc')).__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["cachegen_lab.codecs.kvtc"]


def test_every_codec_is_listed_in_codec_id_order():
    names = "raw int8 fp8 int8-zstd kivi2 cachegen kvtc turboquant tcq".split()
    names += ["lmcache-cachegen", "lmcache-fp8", "lmcache-asym-k16-v8"]
    assert api.available_codecs() == names
    assert all(api._CODECS[name].codec_id == i for i, name in api.RESERVED_IDS.items())


def test_a_stream_of_a_codec_not_registered_names_it_and_the_fix(kivi2_blob, core_only):
    with pytest.raises(CodecError, match="codec id 5: the kivi2 codec is not registered") as e:
        decode(kivi2_blob)
    assert "cachegen_lab.codecs" in str(e.value) and "pip install -e ." in str(e.value)
    with pytest.raises(CodecError, match="the kvtc codec is not registered"):
        get_codec("kvtc")
    api._plugin_errors["kivi2"] = "ImportError: no module named zstandard"
    with pytest.raises(CodecError, match=r"kivi2 codec did not load \(ImportError: no module"):
        decode(kivi2_blob)


def test_a_codec_may_not_take_a_registered_or_reserved_id(core_only):
    class Clash(Int8Codec):
        name = "clash"

    with pytest.raises(CodecError, match="codec id of Clash is taken by Int8Codec"):
        api.register_codec(Clash)

    class Squatter(Int8Codec):
        name, codec_id = "squatter", 10

    with pytest.raises(CodecError, match="codec id 10 is reserved for the kvtc codec"):
        api.register_codec(Squatter)
    assert api.register_codec(Int8Codec) is Int8Codec  # registering again changes nothing
    assert "squatter" not in api._CODECS and "clash" not in api._CODECS
