"""The layer contract (docs/architecture.md): checked by import-linter in `make test`, and
here shown to catch a break, plus what a server's imports pull in at run time."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support import REPO

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )


def test_the_tree_keeps_its_layers():
    result = _lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_import_across_layers_fails_naming_both_modules(tmp_path):
    """A scratch copy of the package where the codec imports a lab module."""
    shutil.copytree(
        REPO / "cachegen", tmp_path / "cachegen", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "cachegen" / "codec" / "api.py", "a") as fh:
        fh.write("\nimport cachegen_lab.bench.plots  # a deliberate break\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "cachegen.codec.api -> cachegen_lab.bench.plots" in result.stdout


def _loaded_after(imports: str) -> list[str]:
    probe = f"import json, sys\n{imports}\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_server_imports_no_lab_module_and_no_plotting():
    loaded = _loaded_after(
        "import cachegen.codec, cachegen.store, cachegen.stream, cachegen.connector\n"
        "from cachegen.connector import config, layouts, scheduler, transport, worker"
    )
    assert not [m for m in loaded if m.startswith("cachegen_lab")]
    assert not [m for m in loaded if m.split(".")[0] in HARNESS_MODULES]
    assert "cachegen.extract" not in loaded  # (vLLM itself imports transformers)


def test_the_connector_loads_link_emulation_only_when_a_request_asks_for_it():
    """The lab's emulated links come through the ``cachegen.links`` entry point, once options
    set a rate or an RTT: the connector's imports and its plain options load none of it."""
    plain = _loaded_after(
        "import cachegen.connector\n"
        "from cachegen.connector import config, links, transport\n"
        "config.ConnectorConfig.from_extra_config({'rtt_ms': 0})"
    )
    assert not [m for m in plain if m.startswith("cachegen_lab")]
    shaped = _loaded_after(
        "from cachegen.connector import config\nconfig.RequestOptions(bandwidth_mbps=100)"
    )
    assert "cachegen_lab.network.link" in shaped


HARNESS_MODULES = ("matplotlib", "jsonschema", "rouge_score", "sacrebleu", "constriction", "asv")


def test_a_core_install_requires_no_harness_library():
    """``pip install cachegen`` is what a server needs; the harness's libraries come with the
    ``lab`` extra only."""
    from importlib.metadata import requires

    harness = {"matplotlib", "jsonschema", "rouge-score", "sacrebleu", "constriction", "asv"}
    core, lab = set(), set()
    for requirement in requires("cachegen"):
        name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()
        (lab if 'extra == "lab"' in requirement else core).add(name)
    assert not harness & core
    assert harness <= lab


def test_decoding_imports_no_model_code():
    loaded = _loaded_after("import cachegen.codec, cachegen.store, cachegen.stream")
    assert not [m for m in loaded if m.split(".")[0] in ("transformers", "vllm", "matplotlib")]
    assert not [m for m in loaded if m in ("cachegen.extract", "cachegen.profiles")]
