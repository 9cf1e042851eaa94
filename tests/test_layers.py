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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "lab")])}
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
    """A scratch copy of both packages where the codec imports a lab module."""
    for package in ("cachegen", "lab/cachegen_lab"):
        shutil.copytree(
            REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
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


def test_the_product_connector_has_no_link_to_emulate():
    """Rates and RTTs are the lab connector's request options, never the product's: its
    imports and options load nothing of the lab, and a request naming a rate is refused."""
    plain = _loaded_after(
        "import cachegen.connector\n"
        "from cachegen.connector import config, sources, transport\n"
        "from cachegen.connector.errors import ConnectorError\n"
        "try:\n"
        "    config.ConnectorConfig.from_extra_config({}).request_options({'rtt_ms': 1})\n"
        "except ConnectorError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('a rate was accepted')"
    )
    assert not [m for m in plain if m.startswith("cachegen_lab")]


HARNESS_MODULES = ("matplotlib", "jsonschema", "rouge_score", "sacrebleu", "constriction", "asv")


def test_a_core_install_requires_no_harness_library():
    """``pip install cachegen`` is what a server needs; the harness's libraries come with the
    lab's distribution, cachegen-lab, which requires cachegen."""
    from importlib.metadata import requires

    def names(distribution: str) -> set[str]:
        return {
            re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()
            for requirement in requires(distribution)
            if "extra ==" not in requirement
        }

    harness = {"matplotlib", "jsonschema", "rouge-score", "sacrebleu", "constriction", "asv"}
    assert not harness & names("cachegen")
    assert harness | {"cachegen"} <= names("cachegen-lab")


def test_importing_the_connector_loads_no_numba():
    """vLLM imports the connector's module while it configures an engine, before its CPU
    worker's start-up, which crashes if llvmlite is loaded already (docs/connector.md, "Known
    issues"): the codec, which loads numba, is imported on first use only."""
    loaded = _loaded_after("from cachegen.connector.connector import CacheGenConnector")
    assert not [m for m in loaded if m.split(".")[0] in ("numba", "llvmlite")]


def test_decoding_imports_no_model_code():
    loaded = _loaded_after("import cachegen.codec, cachegen.store, cachegen.stream")
    assert not [m for m in loaded if m.split(".")[0] in ("transformers", "vllm", "matplotlib")]
    assert not [m for m in loaded if m in ("cachegen.extract", "cachegen.profiles")]
