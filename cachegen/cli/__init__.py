"""The ``cachegen`` command: one entry point, two groups of subcommands.

Library commands work on models, KV caches, bitstreams and stores; lab commands measure, and
come with the lab's distribution (cachegen-lab). Each command module exposes
``register(subparsers)`` that adds its subcommands and sets ``func`` (``handler(args) -> int``)
on each of them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import entry_points

from cachegen import __version__
from cachegen.errors import CacheGenError

LIBRARY_COMMANDS = ["cachegen.cli.models", "cachegen.cli.codec", "cachegen.cli.store"]
# The lab (the cachegen-lab distribution) adds its subcommands through these entry points; a
# server's install has none, and its `cachegen` lists the library commands only.
LAB_COMMANDS_GROUP = "cachegen.commands"


def command_groups() -> dict[str, list[str]]:
    """The modules of each group of subcommands: the library's, then any the lab installs."""
    lab = [entry.value for entry in entry_points(group=LAB_COMMANDS_GROUP)]
    groups = {"library commands": LIBRARY_COMMANDS}
    if lab:
        groups["lab commands (measure)"] = lab
    return groups


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cachegen",
        description="KV-cache compression and streaming for fast LLM serving (CacheGen).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"cachegen {__version__}")
    subparsers = parser.add_subparsers(
        dest="command",
        metavar="COMMAND",
        help="one of the commands below; `cachegen COMMAND --help` for its options",
    )
    epilog = []
    for group, module_names in command_groups().items():
        before = set(subparsers.choices)
        for module_name in module_names:
            importlib.import_module(module_name).register(subparsers)
        helps = {a.dest: a.help for a in subparsers._choices_actions}
        names = [name for name in subparsers.choices if name not in before]
        epilog.append(f"{group}:")
        epilog += [f"  {name:<14} {helps.get(name) or ''}" for name in names]
        epilog.append("")
    parser.epilog = "\n".join(epilog)
    # The epilog lists the commands by group; argparse's own flat list would repeat them.
    subparsers._choices_actions.clear()
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
