"""Let an asv virtualenv use the project's already-installed stack (vLLM, torch, ...).

asv builds one virtualenv per environment and installs the benchmarked commit of cachegen
into it for every commit. Installing vLLM there too would copy gigabytes once more and need
the pinned lock; instead asv.conf.json's install_command runs this script (by path, with the
asv environment's python, standard library only) to drop a ``.pth`` file into that
environment which appends the base virtualenv's site-packages to ``sys.path``. The commit's
own cachegen wheel, installed into the asv environment itself, comes first on ``sys.path``
and so always wins over anything in the base environment. The lab (``cachegen_lab``, a
distribution of its own that the commit's wheel does not hold) comes from the checkout's
``lab/`` folder, like the benchmark suites themselves.

Usage: python lab/cachegen_lab/bench/asv_env.py BASE_VENV   (default: $CACHEGEN_ASV_BASE_VENV, else
the ``.venv`` next to the repository's asv.conf.json)
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

PTH_NAME = "cachegen-asv-base.pth"


def main() -> int:
    repo = Path(__file__).resolve().parents[3]
    base = Path(
        sys.argv[1]
        if len(sys.argv) > 1
        else os.environ.get("CACHEGEN_ASV_BASE_VENV", repo / ".venv")
    )
    python = base / "bin" / "python"
    if not python.is_file():
        print(
            f"asv_env: no virtualenv at {base}; run `make install` first or set "
            "CACHEGEN_ASV_BASE_VENV",
            file=sys.stderr,
        )
        return 1
    purelib = _ask(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    base_version = _ask(python, "import sys; print(sys.version_info[:2])")
    if base_version != str(sys.version_info[:2]):
        print(
            f"asv_env: {base} runs Python {base_version}, this environment {sys.version_info[:2]}; "
            "set pythons in asv.conf.json to the base environment's version",
            file=sys.stderr,
        )
        return 1
    target = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    target.write_text(f"{purelib}\n{repo / 'lab'}\n")
    print(f"asv_env: {target} -> {purelib}")
    return 0


def _ask(python: Path, code: str) -> str:
    """What ``code`` prints when the base environment's ``python`` runs it."""
    return subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
