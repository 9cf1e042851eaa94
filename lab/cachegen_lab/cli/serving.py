"""``cachegen serve-bench``: TTFT and concurrency through vLLM's OpenAI-compatible server with
and without the connector (docs/connector.md, "The OpenAI-compatible server")."""

from __future__ import annotations

import argparse
import json

from cachegen.cli import options
from cachegen_lab.bench import serving


def register(subparsers) -> None:
    p = options.command(
        subparsers,
        "serve-bench",
        _serve_bench,
        help="TTFT and concurrency through vLLM's OpenAI-compatible server, per connector mode",
        description="Per mode, start vLLM's OpenAI-compatible server (recompute: without the "
        "connector; raw, cachegen: with it, a fresh file store), drive it with the openai client "
        "(streamed, greedy) and measure: the TTFT of question 1 over a system document, of "
        "question 2 sent as soon as question 1's last token arrives, and of question 3 once the "
        "document is stored; then CLIENTS concurrent clients x REQUESTS requests over DOCUMENTS "
        "shared documents: errors, p50/p95 TTFT, requests/s, output tokens/s and answers equal "
        "to recompute's. Progress goes to stderr.",
    )
    options.model(p, "model name", default=serving.DEFAULT_MODEL)
    p.add_argument(
        "--modes",
        nargs="+",
        default=list(serving.MODES),
        choices=serving.MODES,
        help="servers to measure, in this order" + options.DEFAULT,
    )
    options.integer(p, "--context-tokens", serving.CONTEXT_TOKENS, "tokens per document")
    options.integer(p, "--clients", serving.CLIENTS, "concurrent clients")
    one_by_one = "requests per client, one after another"
    options.integer(p, "--requests", serving.REQUESTS_PER_CLIENT, one_by_one)
    shared = "shared documents of the concurrent clients"
    options.integer(p, "--documents", serving.DOCUMENTS, shared)
    options.integer(p, "--max-tokens", serving.MAX_TOKENS, "output tokens per request")
    options.integer(
        p,
        "--recompute-runs",
        1,
        "times the recompute server's concurrent phase runs; later runs are compared with "
        "the first, which shows how much recomputing alone varies under concurrency",
    )
    options.json_flag(p, "print the result as JSON (schema and version) instead of tables")


def _serve_bench(args: argparse.Namespace) -> int:
    result = serving.serve_bench(
        args.model,
        args.modes,
        documents_count=args.documents,
        **options.values(
            args, "context_tokens", "clients", "requests", "max_tokens", "recompute_runs"
        ),
    )
    print(json.dumps(result, indent=1) if args.json else serving.markdown(result))
    return 0
