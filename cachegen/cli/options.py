"""What the subcommands' parsers share: adding a subcommand with its handler, and the options
that several commands take, each declared here once with its help text and default."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from cachegen.errors import InputError
from cachegen.models import EMBEDDED_DEFAULT
from cachegen.modes import CACHEGEN, LEVEL_LIMIT, Form, configured_form
from cachegen.store import default_store_url
from cachegen.store.secret_files import inline_password_error

Handler = Callable[[argparse.Namespace], int]
MODEL_HELP = "model name, hub id or directory"
DEFAULT = " (default: %(default)s)"


def command(
    subparsers,
    name: str,
    handler: Handler | None,
    help: str | None,
    description: str | None = None,
) -> argparse.ArgumentParser:
    """Subcommand ``name`` listed with ``help`` (None: not listed); parsing it sets ``func`` to
    ``handler`` (None: its actions set their own)."""
    listed = {} if help is None else {"help": help}
    p = subparsers.add_parser(name, description=description, **listed)
    if handler is not None:
        p.set_defaults(func=handler)
    return p


def actions(p: argparse.ArgumentParser, dest: str = "action", metavar: str = "ACTION"):
    """The required ACTION word of a command made of actions (``cachegen ttft table``)."""
    return p.add_subparsers(dest=dest, metavar=metavar, required=True)


def integer(p, flag: str, default: int | None, help: str | None = None) -> None:
    """An integer option whose help ends with its default."""
    p.add_argument(flag, type=int, default=default, help=help and help + DEFAULT)


def number(p, flag: str, default: float | None, help: str | None = None) -> None:
    """A float option whose help ends with its default."""
    p.add_argument(flag, type=float, default=default, help=help and help + DEFAULT)


def switch(p, flag: str, help: str | None = None) -> None:
    p.add_argument(flag, action="store_true", help=help)


def model(p, help: str | None = MODEL_HELP, default: str | None = EMBEDDED_DEFAULT) -> None:
    """``--model``; with ``default`` None it is required."""
    if default is None:
        p.add_argument("--model", required=True, help=help)
    else:
        p.add_argument("--model", default=default, help=help and help + DEFAULT)


def json_flag(p, help: str = "print JSON") -> None:
    """``--json``: print JSON on stdout instead of text."""
    switch(p, "--json", help)


def json_file(p, help: str = "write the result document here") -> None:
    """``--json FILE``: also write the result as a JSON document."""
    p.add_argument("--json", type=Path, help=help)


def codec(p) -> None:
    p.add_argument("--codec", default="cachegen", help="codec name" + DEFAULT)


def store(p, what: str = "store URL") -> None:
    p.add_argument(
        "--store",
        default=None,
        type=store_url,
        help=f"{what}; a Redis password by ?password_file=PATH or ?password_env=NAME, never "
        f"inline (default: {default_store_url()})",
    )


def store_url(text: str) -> str:
    """A ``--store`` URL; one with its Redis password inline is refused with the fix (a
    command line is seen by ``ps`` and kept in shell history)."""
    refusal = inline_password_error(
        text, "the URL", "a command line is seen by ps and kept in shell history"
    )
    if refusal is not None:
        raise argparse.ArgumentTypeError(str(refusal))  # argparse shows it without the value
    return text


def chunk_tokens(p, help: str = "tokens per chunk" + DEFAULT) -> None:
    p.add_argument("--chunk-tokens", type=int, default=256, help=help)


def seed(p, help: str | None = None) -> None:
    integer(p, "--seed", 0, help)


def no_progress(p, help: str | None = "no progress bar on stderr") -> None:
    switch(p, "--no-progress", help)


def require_positive(args: argparse.Namespace, *names: str) -> None:
    """Refuse an option of ``names`` (attribute names) below 1, naming its flag."""
    for name in names:
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1")


def values(args: argparse.Namespace, *names: str) -> dict:
    """The options ``names`` (attribute names) of ``args``, as keyword arguments of the same
    names."""
    return {name: getattr(args, name) for name in names}


def command_line(words: list[str], args: argparse.Namespace, skip: set[str]) -> str:
    """``words`` and then every option of ``args`` that is set (not None, not False), as
    ``--flag value`` (a flag alone for True), but those named in ``skip``."""
    out = list(words)
    for name, value in vars(args).items():
        if name in skip or value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return " ".join(out)


def level_or_form(codec: str) -> Callable[[str], Form]:
    """An argparse type: the form of ``codec`` a level (``11``: coded) or a form's name
    (``cachegen-11-packed``) names; a slot number is refused
    (``cachegen.modes.configured_form``)."""

    def parse(text: str) -> Form:
        try:
            return configured_form(int(text) if text.isdigit() else text, codec)
        except InputError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def form_name(text: str) -> Form:
    """An argparse type: a form by its name (``cachegen-11-packed``, ``tcq-22``, ``int8``). A
    number names no codec: refused, naming the form a slot number of earlier releases meant."""
    try:
        if text.isdigit():
            if int(text) >= LEVEL_LIMIT:
                configured_form(int(text), CACHEGEN)  # raises, naming the packed form
            raise InputError(f"{text} names no codec: write a form, such as cachegen-{text}")
        return Form.parse(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def record_form(p, required: bool = True) -> None:
    p.add_argument(
        "--form",
        type=form_name,
        required=required,
        default=None,
        help="the record's form by name, such as cachegen-11-packed, tcq-22 or int8",
    )
