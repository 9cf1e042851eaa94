"""Codec commands: ``encode``, ``decode``, ``inspect`` and ``profile build|show``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from cachegen.cli import options
from cachegen.codec import available_codecs, decode, inspect, load_profile
from cachegen.errors import InputError
from cachegen.fileio import write_atomic
from cachegen.fitting.tcq import ensure_tcq_model
from cachegen.kv import KVCache
from cachegen.modes import CODED, FORMS
from cachegen.profiles import codec_for, compile_kernels, ensure_profile

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def register(subparsers) -> None:
    p = options.command(
        subparsers,
        "encode",
        _encode,
        help="compress a saved KV cache into a bitstream",
        description="Encode the KV cache in KV_DIR (from `cachegen extract`) with a codec and "
        "write the bitstream to OUT.",
    )
    p.add_argument("kv_dir", metavar="KV_DIR", type=Path)
    p.add_argument("out", metavar="OUT", type=Path)
    p.add_argument("--codec", required=True, choices=available_codecs())
    p.add_argument(
        "--level", type=int, default=None, help="quality level (default: the codec's default)"
    )
    options.chunk_tokens(p, help="tokens per frame (default 256)")
    p.add_argument(
        "--form",
        choices=FORMS,
        default=CODED,
        help="cachegen and tcq only: entropy-coded symbols (coded, the default: smallest) or "
        "bit-packed at a fixed width (packed: larger, decodes faster to the same KV)",
    )
    options.json_flag(p, "print the inspect summary as JSON")

    p = options.command(
        subparsers,
        "decode",
        _decode,
        help="decode a bitstream back into a KV cache directory",
        description="Decode the bitstream IN (any codec) and save the KV cache into OUT_DIR.",
    )
    p.add_argument("blob", metavar="IN", type=Path)
    p.add_argument("out_dir", metavar="OUT_DIR", type=Path)
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="bfloat16",
        help="dtype of the decoded KV (default bfloat16)",
    )

    p = options.command(
        subparsers,
        "inspect",
        _inspect,
        help="show what a bitstream holds and what it costs",
        description="Print codec, level, token range, bits per element, ratios vs fp16 and int8 "
        "and a per-layer breakdown.",
    )
    p.add_argument("blob", metavar="IN", type=Path)
    options.json_flag(p)
    _register_profile(subparsers)


def _register_profile(subparsers) -> None:
    p = options.command(
        subparsers,
        "profile",
        None,
        help="build or show a model's codec profile (quality levels and probability tables)",
        description="A model's cachegen codec profile: its quality levels and the probability "
        "tables that encoder and decoder share.",
    )
    actions = options.actions(p)
    q = options.command(
        actions,
        "build",
        _profile_build,
        help="build the profile now (runs the model once over the calibration text)",
        description="Build MODEL's profile (paper presets and shipped calibrated levels) and its "
        "tables under the profiles directory (nothing is done if it exists), then run the "
        "codec's kernels once at its default level, so that they are compiled before a "
        "server's first request. With --codec tcq: find the model's shipped tcq model file, "
        "or fit one (minutes) where none ships. A server never builds either: it refuses to "
        "start without them.",
    )
    options.model(q, default=None)
    q.add_argument(
        "--codec",
        choices=("cachegen", "tcq"),
        default="cachegen",
        help="whose file to build: cachegen's profile and tables, or tcq's model file "
        "(default: %(default)s)",
    )
    q = options.command(
        actions,
        "show",
        _profile_show,
        "print the profile as JSON",
        "Print MODEL's profile as JSON.",
    )
    options.model(q, default=None)


def _read(path: Path) -> bytes:
    if not path.is_file():
        raise InputError(f"{path} is not a file")
    return path.read_bytes()


def _encode(args: argparse.Namespace) -> int:
    kv = KVCache.load(args.kv_dir)
    codec = codec_for(args.codec, kv.model.name, chunk_tokens=args.chunk_tokens)
    if args.form not in codec.forms:
        raise InputError(
            f"--form {args.form} is a form of the cachegen and tcq levels; {args.codec} has "
            f"only the {' and '.join(codec.forms)} form: drop --form"
        )
    blob = (
        codec.encode(kv, args.level)
        if args.form == CODED
        else codec.encode(kv, args.level, form=args.form)
    )
    write_atomic(args.out, blob)
    info = inspect(blob)
    if args.json:
        print(json.dumps(info))
    else:
        print(
            f"{args.out}: {info['codec']} level {info['level']} ({info['form']}), "
            f"{info['num_tokens']} tokens, "
            f"{info['bytes']} bytes, "
            f"{info['bits_per_element']:.3f} bits/element, {info['ratio_vs_fp16']:.2f}x vs fp16, "
            f"{info['ratio_vs_int8']:.2f}x vs int8"
        )
    return 0


def _decode(args: argparse.Namespace) -> int:
    kv = decode(_read(args.blob), out_dtype=DTYPES[args.dtype])
    kv.save(args.out_dir)
    print(
        f"{args.out_dir}: {kv.num_tokens} tokens of {kv.model.name} from position {kv.start}",
        file=sys.stderr,
    )
    return 0


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _inspect(args: argparse.Namespace) -> int:
    info = inspect(_read(args.blob))
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"codec            {info['codec']} (level {info['level']}, {info['form']} form)")
    print(f"format version   {info['format_version']}")
    print(
        f"model            {info['model']['name']} ({info['num_layers']} layers, "
        f"{info['num_kv_heads']} kv heads, head_dim {info['head_dim']})"
    )
    print(
        f"tokens           {info['num_tokens']} from position {info['start']}, "
        f"{info['num_frames']} frames of {info['chunk_tokens']}"
    )
    print(
        f"size             {info['bytes']} bytes (header {info['header_bytes']}, "
        f"frame headers {info['frame_header_bytes']}, token ids {info['token_id_bytes']})"
    )
    print(f"bits/element     {_fmt(info['bits_per_element'], '.3f')}")
    print(f"ratio vs fp16    {_fmt(info['ratio_vs_fp16'], '.2f')}x")
    print(f"ratio vs int8    {_fmt(info['ratio_vs_int8'], '.2f')}x")
    if "profile_tables" in info:
        print(f"profile tables   {info['profile_tables']}")
    print("layer  key_bytes  value_bytes  bits/element")
    for row in info["layers"]:
        print(
            f"{row['layer']:5d}  {row['key_bytes']:9.0f}  {row['value_bytes']:11.0f}  "
            f"{_fmt(row['bits_per_element'], '12.3f')}"
        )
    return 0


def _profile_build(args: argparse.Namespace) -> int:
    if args.codec == "tcq":
        tcq = ensure_tcq_model(args.model)
        print(f"tcq model file {tcq.id} for {args.model}: levels {sorted(tcq.levels)}")
        return 0
    profile = ensure_profile(args.model)
    compile_kernels(args.model, profile)
    data = profile.to_dict()
    print(
        f"profile {data['id']} for {profile.model.name}: levels {sorted(profile.levels)}, "
        f"default {profile.default_level}, at {data['path']}"
    )
    return 0


def _profile_show(args: argparse.Namespace) -> int:
    print(json.dumps(load_profile(args.model).to_dict(), indent=1))
    return 0
