"""Foundation subcommands: ``cachegen models`` and ``cachegen extract``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cachegen import models
from cachegen.cli import options
from cachegen.errors import InputError


def register(subparsers) -> None:
    p = options.command(
        subparsers,
        "models",
        _models,
        help="list known models and where they live; optionally prepare them",
        description="List the embedded and tiny models (or resolve the given names) and show "
        "where each lives.",
    )
    p.add_argument(
        "names", nargs="*", help="model names, hub ids or directories (default: the known models)"
    )
    options.switch(p, "--prepare", "convert/build/download the models now")
    options.json_flag(p, "print a JSON list instead of a table")

    p = options.command(
        subparsers,
        "extract",
        _extract,
        help="run a model over text and save its KV cache",
        description="Prefill TEXT with MODEL (transformers) and write the KV cache of every layer "
        "to DIR (kv.safetensors + kv.json).",
    )
    options.model(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="the text to prefill")
    source.add_argument("--text-file", type=Path, help="a UTF-8 file with the text to prefill")
    p.add_argument(
        "--out", type=Path, required=True, help="output directory (must not exist or be empty)"
    )
    options.integer(p, "--prefill-chunk", 512, "tokens per prefill step, bounds memory")
    options.json_flag(p, "print a JSON summary")


def _models(args: argparse.Namespace) -> int:
    names = args.names or models.known_names()
    rows = []
    for name in names:
        if args.prepare:
            models.resolve(name)
        rows.append(models.status(name))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    print(f"{'name':<{width}}  {'source':<8}  {'ready':<5}  path")
    for r in rows:
        print(f"{r['name']:<{width}}  {r['source']:<8}  {str(r['ready']).lower():<5}  {r['path']}")
    return 0


def _extract(args: argparse.Namespace) -> int:
    from cachegen.extract import extract_kv

    if args.text_file is not None:
        try:
            text = args.text_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"cannot read {args.text_file}: {exc}") from exc
    else:
        text = args.text
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        raise InputError(f"{args.out} exists and is not an empty directory; choose a new --out")
    kv = extract_kv(
        args.model, text=text, prefill_chunk_tokens=args.prefill_chunk, progress=sys.stderr.isatty()
    )
    kv.save(args.out)
    summary = {**kv.summary(), "out": str(args.out)}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"{summary['model']}: {summary['num_tokens']} tokens x "
            f"{summary['num_layers']} layers x {summary['num_kv_heads']} kv heads x "
            f"head_dim {summary['head_dim']} ({summary['dtype']}), "
            f"{summary['bytes'] / 1e6:.2f} MB -> {summary['out']}"
        )
    return 0
