"""``cachegen store ...``: put KV or bitstreams into a chunk store, list, inspect, evict."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cachegen.cli import options
from cachegen.errors import InputError
from cachegen.modes import Form, configured_form
from cachegen.store import (
    SLIDING,
    ChunkInfo,
    RecordAddress,
    chunk_keys,
    open_store,
    parse_size,
    stored_prefix,
)
from cachegen.store.keys import SLIDING_SUFFIX, key_scope


def register(subparsers) -> None:
    p = subparsers.add_parser("store", help="manage a chunk store (local directory or Redis)",
                              description="Manage encoded KV chunks in a store addressed by URL: "
                              "file:///dir, redis://host:port/db, valkey://..., "
                              "redis+cluster://host:port.")  # fmt: skip
    sub = options.actions(p, dest="store_command")

    def add(name: str, help: str, func) -> argparse.ArgumentParser:
        q = options.command(sub, name, func, help, description=help)
        options.store(q)
        options.json_flag(q, "print JSON on stdout")
        return q

    q = add("put", "encode a KV directory chunk by chunk at every level and store it", _put)
    q.add_argument("kv_dir", type=Path, help="a KV directory written by `cachegen extract`")
    options.codec(q)
    q.add_argument(
        "--levels", default=None, help="comma list of levels (default: all the codec's levels)"
    )
    options.chunk_tokens(q)
    _scope_arguments(q)

    q = add("put-blob", "store one bitstream file under a key, in its form", _put_blob)
    q.add_argument("file", type=Path)
    q.add_argument("--key", required=True, help=KEY_HELP)
    options.record_form(q)

    q = add("get", "write one stored chunk's payload to a file", _get)
    q.add_argument("--key", required=True, help=KEY_HELP)
    options.record_form(q)
    q.add_argument("--out", type=Path, required=True)

    q = add("lookup", "how many leading chunks of a KV directory's tokens are stored", _lookup)
    q.add_argument("kv_dir", type=Path)
    q.add_argument("--codec", default="cachegen")
    q.add_argument("--levels", default=None)
    q.add_argument("--chunk-tokens", type=int, default=256)
    _scope_arguments(q)

    q = add("ls", "list stored chunks", _ls)
    q.add_argument("--prefix", default="", help="only keys starting with this (e.g. a namespace)")

    add("stats", "count chunks and bytes per namespace", _stats)

    q = add("evict", "remove least recently used chunks", _evict)
    g = q.add_mutually_exclusive_group(required=True)
    g.add_argument("--max-bytes", help="keep at most this much payload (e.g. 2gb)")
    g.add_argument("--all", action="store_true", help="remove every chunk")

    add("profiles", "list the codec profiles the store holds and the adopted ones", _profiles)

    unadopt = (
        "remove a model's adopted-profile pointer: the next producer's profile is adopted "
        "(chunks stored under the old one are no longer found)"
    )
    q = add("unadopt", unadopt, _unadopt)
    q.add_argument(
        "--fingerprint",
        required=True,
        help="the model's weights fingerprint, or a unique start of it (see `profiles`)",
    )
    options.codec(q)

    q = add("rm", "delete one chunk's record in one form (or in every form)", _rm)
    q.add_argument("--key", required=True, help=KEY_HELP)
    options.record_form(q, required=False)


KEY_HELP = "a chunk key as `ls` lists it (a sliding-window part's ends in -sliding)"


def _check_form(blob: bytes, form: Form, what: str = "the record") -> None:
    """Refuse ``blob`` unless it is a bitstream of ``form``: a key's scope belongs to one codec,
    so another codec's form of the same level is stored in the same place."""
    from cachegen.codec import CodecError, form_of

    try:
        written_in = form_of(blob)
    except CodecError as exc:
        raise InputError(f"{what} is not a bitstream: {exc}") from exc
    if written_in != form:
        raise InputError(f"{what} holds the form {written_in.label}, not {form.label}")


def _address(key: str, form: Form) -> RecordAddress:
    """The record ``key`` (as ``ls`` lists it) names in ``form``."""
    if key.endswith(SLIDING_SUFFIX):
        return RecordAddress.of(key.removesuffix(SLIDING_SUFFIX), form, SLIDING)
    return RecordAddress.of(key, form)


def _scope_arguments(q: argparse.ArgumentParser) -> None:
    q.add_argument("--tenant", default=None, help="the connector's tenant option, if it has one")
    q.add_argument(
        "--cache-salt", default=None, help="the requests' cache_salt (vLLM), if they send one"
    )


def _keys(args, codec, kv) -> list[str]:
    """The chunk keys the connector uses for these tokens, in the key scope of the arguments:
    those of an engine serving the KV's model as it is (its directory's weights, no
    ``hf_overrides``, no quantization)."""
    from cachegen.models import resolve

    spec = resolve(kv.model.name)
    if spec.identity().fingerprint != kv.model.fingerprint:
        raise InputError(
            f"the model {kv.model.name} in {spec.path} is not the one this KV was extracted "
            "from (its weights fingerprint differs): extract the KV again"
        )
    salt = key_scope(args.tenant, args.cache_salt)
    weights = spec.served_weights()
    return chunk_keys(
        kv.model, codec.profile_id, kv.token_ids, args.chunk_tokens, weights=weights, salt=salt
    )


def _out(args, data, text: str) -> int:
    """Print ``text``, or with ``--json`` ``data`` as a document of schema
    ``cachegen-store-<action>`` (version 1); a list becomes its ``entries``."""
    if args.json:
        if isinstance(data, list):
            data = {"entries": data}
        if "schema" not in data:
            data = {"schema": f"cachegen-store-{args.store_command}", "version": 1, **data}
        print(json.dumps(data, indent=2))
    else:
        print(text)
    return 0


def _levels(codec, text: str | None) -> list[int]:
    if text is None:
        return list(codec.levels)
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        raise InputError(f"--levels {text!r}: expected integers separated by commas") from None
    for lv in levels:
        codec.resolve_level(lv)
    return levels


def _codec_and_kv(args):
    from cachegen.kv import KVCache
    from cachegen.profiles import codec_for

    kv = KVCache.load(args.kv_dir)
    codec = codec_for(args.codec, kv.model.name, chunk_tokens=args.chunk_tokens)
    return codec, kv


# codec -> its attribute holding the model file its bitstreams name (and need to decode)
MODEL_FILE_CODECS = {"tcq": "tcq", "kvtc": "basis"}


def _store_codec(store, codec, kv, *, publish: bool):
    """``codec`` on the profile ``store`` adopted for the KV's model, as the connector's
    ``profile_source: store`` does (its chunk keys name the profile); ``publish``: with no
    adopted profile, put this machine's (tables, document) into the store and adopt it, and a
    transform codec's model file (tcq, kvtc) into the store."""
    if codec.name in MODEL_FILE_CODECS:
        if publish:
            from cachegen.store.tables import publish_model_file

            publish_model_file(store, getattr(codec, MODEL_FILE_CODECS[codec.name]))
        return codec
    if codec.name != "cachegen":
        return codec
    from cachegen.codec import get_codec
    from cachegen.store.tables import resolve_profile

    local = codec.profile
    choice = resolve_profile(store, kv.model, lambda: local, publish=publish)
    if choice.refused:
        print(f"cachegen store: using the local profile {local.id}: {choice.refused}",
              file=sys.stderr)  # fmt: skip
    return get_codec("cachegen", profile=choice.profile, chunk_tokens=codec.chunk_tokens)


def _put(args) -> int:
    codec, kv = _codec_and_kv(args)
    total = 0
    with open_store(args.store) as store:
        # tables or model file first: the chunks decode anywhere
        codec = _store_codec(store, codec, kv, publish=True)
        levels = _levels(codec, args.levels)
        keys = _keys(args, codec, kv)
        for key, chunk in zip(keys, kv.chunks(args.chunk_tokens)):
            for lv in levels:
                blob = codec.encode(chunk, level=lv)
                store.write(RecordAddress.of(key, configured_form(lv, codec.name)), blob)
                total += len(blob)
        url = store.label  # never the password a Redis URL may carry
    data = {"store": url, "codec": codec.name, "profile_id": codec.profile_id, "levels": levels,
            "chunks": len(keys), "bytes": total, "keys": keys}  # fmt: skip
    return _out(args, data, f"stored {len(keys)} chunks x levels {levels} ({total} bytes) in {url}")


def _put_blob(args) -> int:
    try:
        blob = args.file.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {args.file}: {exc}") from exc
    _check_form(blob, args.form, str(args.file))
    with open_store(args.store) as store:
        store.write(_address(args.key, args.form), blob)
    return _out(
        args,
        {"key": args.key, "form": args.form.label, "bytes": len(blob)},
        f"stored {len(blob)} bytes",
    )


def _get(args) -> int:
    with open_store(args.store) as store:
        blob = store.read(_address(args.key, args.form))
    _check_form(blob, args.form)
    tmp = args.out.with_name(args.out.name + ".part")
    tmp.write_bytes(blob)
    tmp.replace(args.out)
    return _out(
        args,
        {"key": args.key, "form": args.form.label, "bytes": len(blob)},
        f"wrote {len(blob)} bytes to {args.out}",
    )


def _lookup(args) -> int:
    codec, kv = _codec_and_kv(args)
    with open_store(args.store) as store:
        codec = _store_codec(store, codec, kv, publish=False)
        levels = _levels(codec, args.levels)
        keys = _keys(args, codec, kv)
        forms = [configured_form(lv, codec.name) for lv in levels]
        n = stored_prefix(store, [[RecordAddress.of(key, f) for f in forms] for key in keys])
    tokens = min(n * args.chunk_tokens, kv.num_tokens)
    data = {
        "chunks": len(keys),
        "stored_prefix_chunks": n,
        "stored_prefix_tokens": tokens,
        "levels": levels,
    }
    return _out(
        args,
        data,
        f"{n} of {len(keys)} chunks ({tokens} of {kv.num_tokens} tokens) stored at levels {levels}",
    )


def _ls(args) -> int:
    with open_store(args.store) as store:
        entries = [(e, store.form_of(e)) for e in store.list(args.prefix)]
    rows = [
        {"key": e.key, "form": form and form.label, "bytes": e.size, "last_used": e.last_used}
        for e, form in entries
    ]
    lines = [f"{e.key}  {form.label if form else '?'}  {e.size}" for e, form in entries]
    text = "\n".join(lines) or "(empty)"
    return _out(args, rows, text)


def _stats(args) -> int:
    """The store's chunks, entries and payload bytes (per namespace), and ``raw_bf16_bytes``:
    the raw bf16 KV the stored chunks hold, each chunk's once whatever codecs and levels it is
    stored in (:func:`_raw_bf16_bytes`), with ``payload_to_raw`` their ratio and
    ``raw_bf16_skipped_keys`` the keys whose record is not a bitstream (not counted)."""
    with open_store(args.store) as store:
        stats = store.stats().to_dict()
        raw, skipped = _raw_bf16_bytes(store)
    stats["raw_bf16_bytes"] = raw
    stats["payload_to_raw"] = round(stats["payload_bytes"] / raw, 4) if raw else None
    if skipped:
        stats["raw_bf16_skipped_keys"] = skipped
    text = "\n".join(f"{k}: {v}" for k, v in stats.items())
    return _out(args, stats, text)


# Enough for any bitstream header (fixed part, model name and fingerprint, codec parameters,
# layer list) and a connector chunk's token ids; a record that needs more is read whole.


def _raw_bf16_bytes(store) -> tuple[int, int]:
    """What the stored chunks hold as raw bf16 KV: 2 bytes per key and value element, each
    chunk's KV counted once whatever codecs and levels it is stored in. Returns (bytes, keys
    whose record is not a bitstream).

    A key's records are forms of one KV, so each key is read once, at its first listed form,
    and only the start of its record: the bitstream header and the frames' token ids, nothing
    decoded or verified. Records hold the same KV when they name the same model (name,
    fingerprint, geometry), start and token count, and the same token ids (a SHA-256 of
    them); chunk keys cannot tell, as they differ per codec profile (a mixed save ladder
    stores a chunk under tcq's key and cachegen's). A record counts only the layers its header
    lists, so a chunk stored as parts (full-attention and sliding layers) adds up to one copy.
    Copies under several keys of one namespace (one model, codec profile and chunking: two
    tenants' or cache_salts' keys, or the same tokens after different prefixes) are separate
    KV and each counted: a layer of a KV counts as many times as the most keys of any one
    namespace hold it. (A record does not say what came before its tokens, so the same
    tokens at the same position after different prefixes, stored only under different
    codecs' keys, count once.)"""
    import hashlib

    from cachegen.codec.errors import CodecError
    from cachegen.errors import CacheGenError

    first: dict[str, ChunkInfo] = {}
    for info in store.list():
        if info.key not in first or info.level < first[info.key].level:
            first[info.key] = info
    held: dict[tuple, dict[str, int]] = {}  # (KV, layer) -> namespace -> keys holding it
    layer_bytes: dict[tuple, int] = {}  # KV -> raw bf16 bytes of one of its layers
    skipped = 0
    for key, info in sorted(first.items()):
        try:
            head = store.record_start(info)
            try:
                header, ids = _header_and_token_ids(head)
            except CodecError:
                if len(head) >= info.size:  # the whole record: not a bitstream
                    raise
                (whole,) = store.read_listed([info])
                if isinstance(whole, CacheGenError):
                    raise whole
                header, ids = _header_and_token_ids(whole)
        except CacheGenError:  # not a bitstream, damaged, or removed since the listing
            skipped += 1
            continue
        digest = hashlib.sha256(ids.astype("<i8").tobytes()).digest()
        kv = (header.model, header.start, header.num_tokens, digest)
        layer_bytes[kv] = 2 * 2 * header.num_kv_heads * header.head_dim * header.num_tokens
        namespace = key.split("/", 1)[0]
        for layer in header.layer_indices:
            keys = held.setdefault((kv, layer), {})
            keys[namespace] = keys.get(namespace, 0) + 1
    total = sum(max(keys.values()) * layer_bytes[kv] for (kv, _), keys in held.items())
    return total, skipped


def _header_and_token_ids(blob: bytes):
    from cachegen.codec.coding.bitstream import parse_header, read_token_ids

    header = parse_header(blob)
    return header, read_token_ids(blob, header)


def _evict(args) -> int:
    limit = 0 if args.all else parse_size(args.max_bytes)
    with open_store(args.store) as store:
        removed = store.evict(limit)
        left = store.stats().payload_bytes
    return _out(
        args,
        {"removed": removed, "payload_bytes_left": left},
        f"removed {removed} entries; {left} bytes left",
    )


def _rm(args) -> int:
    with open_store(args.store) as store:
        if args.form is None:
            removed = store.delete(args.key)
        else:
            removed = store.remove(_address(args.key, args.form))
    if not removed:
        print(f"cachegen store rm: nothing stored under {args.key}", file=sys.stderr)
    return _out(args, {"removed": removed}, f"removed {removed} entries")


PROFILES_SCHEMA = "cachegen-store-profiles"
PROFILES_VERSION = 1


def _profiles(args) -> int:
    from cachegen.store.tables import describe_profiles

    with open_store(args.store) as store:
        data = describe_profiles(store)
    doc = {"schema": PROFILES_SCHEMA, "version": PROFILES_VERSION, "store": store.label, **data}
    lines = [
        f"{p['id']}  {p['model']['name'] if p['model'] else '?'}  levels {p['levels']}  "
        f"{p['bytes']} bytes{'  adopted' if p['adopted'] else ''}{_problem(p)}"
        for p in data["profiles"]
    ]
    lines += [
        f"adopted: {a['fingerprint'][:16]} {a['codec']} -> {a['profile']}{_problem(a)}"
        for a in data["adopted"]
    ]
    return _out(args, doc, "\n".join(lines) or "(no profiles)")


def _problem(entry: dict) -> str:
    return f"  REFUSED: {entry['error']}" if entry.get("error") else ""


def _unadopt(args) -> int:
    with open_store(args.store) as store:
        pointers = store.pointers()
        found = [fp for fp, codec in pointers if codec == args.codec]
        found = [fp for fp in found if fp.startswith(args.fingerprint)]
        if len(found) != 1:
            what = "no" if not found else f"{len(found)}"
            raise InputError(
                f"{what} adopted {args.codec} profiles for a model fingerprint starting with "
                f"{args.fingerprint!r} in {store.label}; see `cachegen store profiles`"
            )
        store.delete_pointer(found[0], args.codec)
    text = f"removed the adopted {args.codec} profile of model {found[0][:16]}"
    return _out(args, {"removed": found[0], "codec": args.codec}, text)
