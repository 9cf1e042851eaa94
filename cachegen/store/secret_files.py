"""Secrets kept off command lines: read from a file that only its owner can read, or from an
environment variable, never given inline where a command line or a log would show them.

A secret file is a regular file of UTF-8 text, with no permission for its group or others
(``chmod 600``); trailing line breaks are not part of the secret (``echo`` writes one). Every
error names the file or the variable, never what it holds.
"""

from __future__ import annotations

import os
import stat
from urllib.parse import parse_qsl, urlsplit

from cachegen.store.errors import StoreConfigError

MAX_SECRET_BYTES = 64 * 1024  # a secret is short: a larger file is the wrong file
PASSWORD_FILE, PASSWORD_ENV = "password_file", "password_env"
INLINE_FIX = (
    "put the password in a file only this user can read (chmod 600) and name it in the URL, "
    f"redis://[USER@]HOST:PORT/DB?{PASSWORD_FILE}=/path/to/file, or name an environment "
    f"variable that holds it, ?{PASSWORD_ENV}=NAME"
)


def read_secret_file(path: str | os.PathLike, what: str) -> str:
    """The secret in the file at ``path`` (``what`` names it in errors), trailing line breaks
    removed. A file that is missing, unreadable, not a regular file, open to its group or
    others, empty, too large or not UTF-8 text raises ``StoreConfigError``."""
    shown = os.fspath(path)
    full = os.path.expanduser(shown)
    try:
        mode = os.stat(full).st_mode
        if not stat.S_ISREG(mode):
            raise StoreConfigError(f"{what} {shown!r} is not a regular file")
        if mode & 0o077:
            raise StoreConfigError(
                f"{what} {shown!r} is open to its group or others (mode "
                f"{stat.S_IMODE(mode):04o}): make it readable by its owner only, chmod 600 {shown}"
            )
        with open(full, "rb") as fh:
            data = fh.read(MAX_SECRET_BYTES + 1)
    except FileNotFoundError:
        raise StoreConfigError(f"{what} {shown!r} does not exist") from None
    except PermissionError:
        raise StoreConfigError(
            f"{what} {shown!r} cannot be read by this user: make the user that runs this "
            "process its owner (chmod 600 keeps it private)"
        ) from None
    except OSError as exc:
        raise StoreConfigError(f"cannot read {what} {shown!r}: {exc.strerror}") from None
    return _secret_text(data, what, shown)


def _secret_text(data: bytes, what: str, shown: str) -> str:
    if len(data) > MAX_SECRET_BYTES:
        raise StoreConfigError(
            f"{what} {shown!r} is larger than {MAX_SECRET_BYTES // 1024} KiB: name the file "
            "that holds the secret alone"
        )
    try:
        text = data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise StoreConfigError(
            f"{what} {shown!r} is not UTF-8 text: write the secret as text, e.g. "
            "python -c 'import secrets; print(secrets.token_hex(32))' > FILE"
        ) from None
    if not text:
        raise StoreConfigError(f"{what} {shown!r} is empty")
    return text


def read_secret_env(name: str, what: str) -> str:
    """The secret in environment variable ``name``; unset or empty raises
    ``StoreConfigError``."""
    value = os.environ.get(name)
    if not value:
        raise StoreConfigError(
            f"{what}: the environment variable {name} is {'empty' if value == '' else 'not set'}"
            f": export the secret in {name} before starting this process"
        )
    return value


def named_password(url: str) -> str | None:
    """The password a Redis store URL names by its ``password_file`` or ``password_env`` query
    option; None when it names none that way. Naming it twice (inline too), or in a
    ``password`` query option, is refused."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    if "password" in query:
        raise StoreConfigError(
            "a password in the store URL's query is shown wherever the URL is: " + INLINE_FIX
        )
    named = [name for name in (PASSWORD_FILE, PASSWORD_ENV) if name in query]
    if len(named) + (parts.password is not None) > 1:
        raise StoreConfigError(
            "the store URL names its password more than once (inline, password_file, "
            "password_env): give one"
        )
    if PASSWORD_FILE in named:
        return read_secret_file(query[PASSWORD_FILE], "the store URL's password_file")
    if PASSWORD_ENV in named:
        return read_secret_env(query[PASSWORD_ENV], "the store URL's password_env")
    return None


def inline_password_error(url: str, where: str, why: str) -> StoreConfigError | None:
    """The refusal of store URL ``url``, given as ``where`` (``why``: who sees it), when it
    carries its password inline; None when it does not. The message never shows the
    password."""
    parts = urlsplit(url)
    inline = parts.password is not None
    queried = any(n == "password" for n, _ in parse_qsl(parts.query, keep_blank_values=True))
    if not (inline or queried):
        return None
    return StoreConfigError(f"{where} carries its Redis password inline, and {why}: {INLINE_FIX}")
