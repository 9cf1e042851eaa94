"""``cachegen codec-report``: the measurements behind docs/codec.md."""

from __future__ import annotations


def register(subparsers) -> None:
    from cachegen.lab.bench import codec_report

    p = subparsers.add_parser(
        "codec-report",
        help="measure every codec and level on held-out text and write the docs/codec.md tables",
        description="Run the measurements behind docs/codec.md (sizes on held-out pydoc text, "
        "encode/decode speed from pytest-benchmark JSON).",
    )
    codec_report.add_arguments(p)
    p.set_defaults(func=codec_report.run)
