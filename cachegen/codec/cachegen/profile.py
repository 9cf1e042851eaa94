"""A model's codec profile: its quality levels, their tables ids and the default level.

The profile is what a model's encoder uses: quality levels (id -> quantization config, with
the paper's presets 1/2/3 scaled to depth and any calibrated levels), the default level, and
the id of each level's probability tables (``cachegen.codec.coding.tables``). It is stored as
``profiles_dir()/<fingerprint[:16]>/profile.json``; ``Profile.id`` is the hash of that
content and names the store's chunk keys.

This module reads and writes profiles; it never builds one. Building runs the model over
the calibration text and lives above the codec: ``cachegen.profiles.ensure_profile`` (or
``cachegen profile build``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cachegen import models
from cachegen.codec.cachegen.quant import QuantConfig
from cachegen.codec.coding.tables import LevelTables, find_tables, profiles_dir
from cachegen.codec.errors import CodecError
from cachegen.errors import CacheGenError
from cachegen.fileio import check_version, versioned, write_atomic
from cachegen.kv import ModelIdentity

SCHEMA = "cachegen-codec-profile"
VERSION = 2
SHIPPED_SCHEMA = "cachegen-calibrated-levels"
SHIPPED_VERSION = 1
SHIPPED_DIR = Path(__file__).parents[1] / "calibrated"
DEFAULT_LEVEL = 2


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on ``directory`` (across processes) while a profile changes."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _canonical(data: dict) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


@dataclass
class Profile:
    """A model's quality levels (id -> config), their tables ids and the default level.

    ``calibration`` says what the tables were calibrated on (written by the builder).
    """

    model: ModelIdentity
    levels: dict[int, QuantConfig]
    tables_ids: dict[int, str]
    default_level: int
    calibration: dict

    @property
    def id(self) -> str:
        """Content hash of the profile (levels, tables ids, default, calibration)."""
        return hashlib.sha256(_canonical(self._content())).hexdigest()[:16]

    @property
    def path(self) -> Path:
        return profile_path(self.model)

    def calibrated_levels(self) -> list[int]:
        """The levels that are the model's shipped calibration, unchanged: ``cachegen
        calibrate``'s choices for measured perplexity targets (docs/quality.md). Empty for a
        model without one."""
        shipped, _ = shipped_levels(self.model)
        return sorted(
            level for level, config in shipped.items() if self.levels.get(level) == config
        )

    def config(self, level: int) -> QuantConfig:
        if level not in self.levels:
            raise CodecError(
                f"level {level} is not defined for {self.model.name}; "
                f"levels are {sorted(self.levels)}"
            )
        return self.levels[level]

    def tables(self, level: int) -> LevelTables:
        return find_tables(self.tables_ids[level], self.config(level), self.model)

    def put_level(
        self, level: int, config: QuantConfig, tables_id: str, *, make_default: bool = False
    ) -> None:
        """Store ``config`` (whose tables are ``tables_id``) as ``level``, replacing any."""
        if not 0 <= int(level) <= 0xFFFF:
            raise CodecError(f"level ids are 0..65535, got {level}")
        with self._editing():
            self.levels[int(level)] = config
            self.tables_ids[int(level)] = tables_id
            if make_default:
                self.default_level = int(level)

    def set_default_level(self, level: int) -> None:
        with self._editing():
            self.config(level)
            self.default_level = int(level)

    def remove_level(self, level: int) -> None:
        with self._editing():
            self.config(level)
            if level == self.default_level:
                raise CodecError(f"level {level} is the default; set another default first")
            del self.levels[level], self.tables_ids[level]

    @contextlib.contextmanager
    def _editing(self) -> Iterator[None]:
        """An edit of the profile as saved, under the profile directory's lock; saved unless
        the edit raises."""
        with locked(self.path.parent):
            self._reload()
            yield
            self.save()

    def to_dict(self) -> dict:
        return {"id": self.id, "path": str(self.path), **self._content()}

    def _content(self) -> dict:
        return versioned(
            SCHEMA,
            VERSION,
            {
                "model": self.model.to_dict(),
                "calibration": self.calibration,
                "default_level": self.default_level,
                "levels": {
                    str(k): {"config": self.levels[k].to_dict(), "tables": self.tables_ids[k]}
                    for k in sorted(self.levels)
                },
            },
        )

    def save(self) -> None:
        data = json.dumps(self._content(), indent=1, sort_keys=True).encode() + b"\n"
        write_atomic(self.path, data)

    def _reload(self) -> None:
        """Pick up levels another process added since this profile was loaded."""
        fresh = read_profile(self.model)
        if fresh is not None:
            self.levels, self.tables_ids, self.default_level = (
                fresh.levels,
                fresh.tables_ids,
                fresh.default_level,
            )


def profile_path(model: ModelIdentity) -> Path:
    return profiles_dir() / model.fingerprint[:16] / "profile.json"


def read_profile(model: ModelIdentity) -> Profile | None:
    """The stored profile of ``model``; None if there is none or it predates this format
    (a profile is a cache: the builder writes a new one)."""
    path = profile_path(model)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") == SCHEMA:  # version 1 wrote "format"; rebuilt, not migrated
            return None
        return _from_dict(data, model, str(path))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, CacheGenError) as exc:
        raise CodecError(
            f"codec profile {path} is unreadable ({exc}); delete it and run "
            f"`cachegen profile build --model {model.name}`"
        ) from exc


def _from_dict(data: dict, model: ModelIdentity, where: str) -> Profile:
    check_version(data, SCHEMA, (VERSION,), where)
    levels = {int(k): QuantConfig.from_dict(v["config"]) for k, v in data["levels"].items()}
    tables_ids = {int(k): str(v["tables"]) for k, v in data["levels"].items()}
    default = int(data["default_level"])
    if default not in levels:
        raise ValueError("default level is not defined")
    return Profile(model, levels, tables_ids, default, dict(data["calibration"]))


# A profile travels (in a chunk store) as its canonical document: the bytes its id hashes.


def profile_document(profile: Profile) -> bytes:
    """The canonical bytes of ``profile`` (``Profile.id`` is the start of their SHA-256)."""
    return _canonical(profile._content())


def profile_from_document(data: bytes, where: str) -> Profile:
    """The profile whose canonical document is ``data``; ``CodecError`` saying what is wrong
    when it is not one, or when its content does not hash to the id it had when written."""
    try:
        doc = json.loads(data)
        profile = _from_dict(doc, ModelIdentity.from_dict(doc["model"]), where)
    except (ValueError, KeyError, TypeError, AttributeError, CacheGenError) as exc:
        raise CodecError(f"codec profile {where} is unreadable ({exc})") from exc
    if profile_document(profile) != bytes(data):
        raise CodecError(f"codec profile {where} is not in canonical form")
    return profile


def shipped_levels(model: ModelIdentity) -> tuple[dict[int, QuantConfig], int | None]:
    """Levels that ``cachegen calibrate`` chose for ``model`` and that ship with the package
    (``cachegen/codec/calibrated/*.json``, matched by weights fingerprint), and their default.

    They let a fresh install use the calibrated default without running the calibration.
    """
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        data = check_version(
            json.loads(path.read_text()), SHIPPED_SCHEMA, (SHIPPED_VERSION,), str(path)
        )
        if data["model"]["fingerprint"] == model.fingerprint:
            levels = {int(k): QuantConfig.from_dict(v["config"]) for k, v in data["levels"].items()}
            return levels, int(data["default_level"])
    return {}, None


def load_profile(model: str | models.ModelSpec) -> Profile:
    """The stored profile of ``model``. Never builds one: ``CodecError`` says how."""
    spec = models.resolve(model) if isinstance(model, str) else model
    profile = read_profile(spec.identity())
    if profile is None:
        raise CodecError(
            f"no codec profile for {spec.name} in {profile_path(spec.identity()).parent}; run "
            f"`cachegen profile build --model {spec.name}` (or cachegen.profiles.ensure_profile)"
        )
    return profile
