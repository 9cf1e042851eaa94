"""``cachegen serve-bench``: TTFT and concurrency through vLLM's OpenAI-compatible server with
and without the connector (docs/connector.md, "The OpenAI-compatible server")."""

from __future__ import annotations

import argparse
import json

from cachegen.lab.bench import serving


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve-bench",
        help="TTFT and concurrency through vLLM's OpenAI-compatible server, per connector mode",
        description="Per mode, start vLLM's OpenAI-compatible server (recompute: without the "
        "connector; raw, cachegen: with it, a fresh file store), drive it with the openai client "
        "(streamed, greedy) and measure: the TTFT of question 1 over a system document, of "
        "question 2 sent as soon as question 1's last token arrives, and of question 3 once the "
        "document is stored; then CLIENTS concurrent clients x REQUESTS requests over DOCUMENTS "
        "shared documents: errors, p50/p95 TTFT, requests/s, output tokens/s and answers equal "
        "to recompute's. Progress goes to stderr.",
    )
    p.add_argument(
        "--model", default=serving.DEFAULT_MODEL, help="model name (default: %(default)s)"
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=list(serving.MODES),
        choices=serving.MODES,
        help="servers to measure, in this order (default: %(default)s)",
    )
    p.add_argument(
        "--context-tokens",
        type=int,
        default=serving.CONTEXT_TOKENS,
        help="tokens per document (default: %(default)s)",
    )
    p.add_argument(
        "--clients",
        type=int,
        default=serving.CLIENTS,
        help="concurrent clients (default: %(default)s)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=serving.REQUESTS_PER_CLIENT,
        help="requests per client, one after another (default: %(default)s)",
    )
    p.add_argument(
        "--documents",
        type=int,
        default=serving.DOCUMENTS,
        help="shared documents of the concurrent clients (default: %(default)s)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=serving.MAX_TOKENS,
        help="output tokens per request (default: %(default)s)",
    )
    p.add_argument(
        "--recompute-runs",
        type=int,
        default=1,
        help="times the recompute server's concurrent phase runs; later runs are compared with "
        "the first, which shows how much recomputing alone varies under concurrency "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the result as JSON (schema and version) instead of tables",
    )
    p.set_defaults(func=_serve_bench)


def _serve_bench(args: argparse.Namespace) -> int:
    result = serving.serve_bench(
        args.model,
        args.modes,
        context_tokens=args.context_tokens,
        clients=args.clients,
        requests=args.requests,
        documents_count=args.documents,
        max_tokens=args.max_tokens,
        recompute_runs=args.recompute_runs,
    )
    print(json.dumps(result, indent=1) if args.json else serving.markdown(result))
    return 0
