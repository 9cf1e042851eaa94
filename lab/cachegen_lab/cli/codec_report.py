"""``cachegen codec-report``: the measurements behind docs/codec.md."""

from __future__ import annotations

from cachegen.cli import options


def register(subparsers) -> None:
    from cachegen_lab.bench import codec_report

    p = options.command(
        subparsers,
        "codec-report",
        codec_report.run,
        help="measure every codec and level, and the peer codecs (LMCache's), on held-out text "
        "and write the docs/codec.md tables",
        description="Run the measurements behind docs/codec.md (sizes on held-out pydoc text of "
        "cachegen's levels, the baselines and the peer codecs that run LMCache's own code; "
        "encode/decode speed from pytest-benchmark JSON).",
    )
    codec_report.add_arguments(p)
