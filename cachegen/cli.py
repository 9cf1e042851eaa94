"""The ``cachegen`` command: one entry point, subcommands contributed by each area.

Each module in ``COMMAND_MODULES`` exposes ``register(subparsers)`` that adds its
subcommands and sets ``func`` (``handler(args) -> int``) on each of them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from cachegen import __version__
from cachegen.errors import CacheGenError

COMMAND_MODULES = [
    "cachegen.commands",
    "cachegen.quality.cli",
    "cachegen.codec.cli",
    "cachegen.bench.cli",
    "cachegen.store.cli",
    "cachegen.stream.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cachegen",
        description="KV-cache compression and streaming for fast LLM serving (CacheGen).",
    )
    parser.add_argument("--version", action="version", version=f"cachegen {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except CacheGenError as exc:
        print(f"cachegen {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"cachegen {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
