"""``cachegen fleet-bench``: N vLLM OpenAI-compatible servers sharing one chunk store, a
client-side router, seeded workloads and a record per request (docs/fleet.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cachegen.cli import options
from cachegen.fileio import write_atomic
from cachegen.models import EMBEDDED_DEFAULT
from cachegen.workload import DOMAINS
from cachegen_lab.bench.links import UNLIMITED
from cachegen_lab.fleet import client, configs, lmcache, router, workloads
from cachegen_lab.fleet.drive import FleetError, Stop
from cachegen_lab.fleet.run import KV_CACHE_GIB, LOCAL_CLUSTER, MAX_TOKENS, SERVERS


def register(subparsers) -> None:
    p = options.command(
        subparsers,
        "fleet-bench",
        _fleet_bench,
        help="N OpenAI-compatible vLLM servers sharing one store, a router, per-request records",
        description="Per configuration, one after another: start SERVERS vLLM OpenAI-compatible "
        "servers (prefix-cache: vLLM's prefix cache, no connector; recompute: no cache; raw, "
        "int8, default, adaptive: the connector in that mode over one fresh store shared by the "
        "servers, vLLM's prefix cache on; lmcache, on a GPU machine only: LMCache's own "
        "connector over the --store Redis), send a seeded workload (multi-round-qa: users with a "
        "shared system prompt and their own growing chat history, each round waiting for that "
        "user's answer; long-doc-qa: questions about long documents in shuffled order) through "
        "a client-side router, at most CONCURRENCY requests in flight, each streamed and timed, "
        "once per link rate between the connector's servers and the store; optionally stop one "
        "server mid-run and fail its requests over; record every request (server, send time, "
        "TTFT, end time, tokens, the connector's report, error, failed attempts) and summarize "
        "per run (TTFT p50/p90/p99, requests/s, output tokens/s, connector hit rate, loaded "
        "bytes, errors, failovers). Progress goes to stderr. A configuration that fails ends "
        "the command with an error; --json keeps the runs done before it and the failure.",
    )
    options.model(p, "model name", default=EMBEDDED_DEFAULT)
    p.add_argument(
        "--configs",
        nargs="+",
        default=list(configs.DEFAULT_CONFIGS),
        choices=configs.CONFIGS,
        help="configurations to run, in this order, each on fresh servers; lmcache needs "
        "CUDA and a redis:// --store (default: all but lmcache)",
    )
    options.integer(p, "--servers", SERVERS, "servers of the fleet")
    p.add_argument(
        "--router",
        default=router.ROUND_ROBIN,
        choices=router.ROUTERS,
        help="round-robin: request i to server i mod N; sticky: a user's or document's "
        "requests to one server" + options.DEFAULT,
    )
    options.integer(p, "--concurrency", None, "requests in flight at most (default: --servers)")
    _workload_options(p)
    _sending_options(p)
    _fleet_options(p)
    options.json_file(p, "write the versioned document (every record) here instead of the table")


def _workload_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        default=workloads.MULTI_ROUND,
        choices=workloads.WORKLOADS,
        help="what the clients ask" + options.DEFAULT,
    )
    options.integer(p, "--users", 4, "multi-round-qa: users")
    options.integer(p, "--rounds", 3, "multi-round-qa: questions per user, one per round")
    options.integer(p, "--system-tokens", 1024, "multi-round-qa: tokens of the system prompt")
    options.integer(p, "--question-tokens", 256, "multi-round-qa: tokens of a question's passage")
    options.integer(
        p,
        "--history-tokens",
        0,
        "multi-round-qa: tokens of each user's own context, sent with its first question",
    )
    options.integer(p, "--documents", 2, "long-doc-qa: documents")
    options.integer(p, "--document-tokens", 2048, "long-doc-qa: tokens per document")
    options.integer(p, "--questions", 3, "long-doc-qa: questions per document")
    p.add_argument(
        "--domain",
        default="pydoc",
        choices=DOMAINS,
        help="held-out text the prompts are cut from" + options.DEFAULT,
    )
    options.seed(p, "seed of the workload (passages, order)")


def _sending_options(p: argparse.ArgumentParser) -> None:
    options.integer(p, "--max-tokens", MAX_TOKENS, "greedy output tokens per request (at least 2)")
    options.switch(p, "--ignore-eos", "generate --max-tokens tokens always (vLLM's ignore_eos)")
    p.add_argument(
        "--api",
        default=client.RESPONSES,
        choices=client.APIS,
        help="responses: streamed /v1/responses, whose last event carries the connector's "
        "report; chat: streamed chat completions (no report)" + options.DEFAULT,
    )


def _fleet_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--bandwidth-mbps",
        nargs="+",
        type=_rate,
        default=[None],
        metavar="RATE",
        help="link rates between each connector server and the store, in Mbit/s, or "
        f"{UNLIMITED}: one run per rate on the same servers, each with its own cache_salt "
        f"(default: {UNLIMITED})",
    )
    p.add_argument(
        "--store",
        default=None,
        help="where the connector's servers share chunks: a file:// directory (a fresh "
        "subdirectory per configuration), a redis://, rediss:// or redis+cluster:// URL (keys "
        f"scoped per configuration), or {LOCAL_CLUSTER} (a Redis Cluster of six local "
        "redis-server nodes started for the bench); default: a fresh temporary directory per "
        "configuration",
    )
    options.integer(
        p, "--stop-server", None, "stop (SIGTERM) this server mid-run; its requests fail over"
    )
    options.integer(
        p,
        "--stop-after",
        4,
        "--stop-server: once this many requests of the run have ended, answered or failed "
        "(fewer than the run's requests)",
    )
    options.number(p, "--slo-ms", configs.SLO_MS, "adaptive: time budget of a load in ms")
    options.integer(
        p, "--kv-cache-gib", KV_CACHE_GIB, "VLLM_CPU_KVCACHE_SPACE of each server (GiB)"
    )
    p.add_argument(
        "--kv-cache-blocks",
        type=int,
        metavar="BLOCKS",
        help="hold each server's KV cache (vLLM's prefix cache included) to this many blocks "
        "(vLLM's --num-gpu-blocks-override; a block holds 128 tokens on CPU), so that long "
        "documents exceed it; at least the longest prompt's blocks plus one (default: what "
        "--kv-cache-gib holds)",
    )
    p.add_argument("--log-dir", type=Path, help="keep each server's log here")


def _rate(text: str) -> float | None:
    if text == UNLIMITED:
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a rate in Mbit/s (100) or {UNLIMITED}"
        ) from None


def _workload(args: argparse.Namespace) -> workloads.Workload:
    from transformers import AutoTokenizer

    from cachegen.models import resolve

    tokenizer = AutoTokenizer.from_pretrained(str(resolve(args.model).path))
    if args.workload == workloads.LONG_DOC:
        return workloads.long_doc_qa(
            tokenizer,
            **options.values(args, "documents", "document_tokens", "questions", "seed", "domain"),
        )
    return workloads.multi_round_qa(
        tokenizer,
        **options.values(
            args,
            "users",
            "rounds",
            "system_tokens",
            "history_tokens",
            "question_tokens",
            "max_tokens",
            "seed",
        ),
        domain=args.domain,
    )


def _fleet_bench(args: argparse.Namespace) -> int:
    from cachegen_lab.fleet.run import fleet_bench
    from cachegen_lab.fleet.summary import markdown

    options.require_positive(args, "servers", "max_tokens")
    lmcache.check(args.configs, args.store)  # before the workload's tokenizer loads
    work = _workload(args)
    stop = None if args.stop_server is None else Stop(args.stop_server, args.stop_after)
    doc = fleet_bench(
        args.model,
        work,
        args.configs,
        bandwidths=args.bandwidth_mbps,
        stop=stop,
        **options.values(
            args,
            "servers",
            "router",
            "concurrency",
            "max_tokens",
            "api",
            "ignore_eos",
            "store",
            "slo_ms",
            "kv_cache_gib",
            "kv_cache_blocks",
            "log_dir",
        ),
    )
    if args.json:
        write_atomic(args.json, json.dumps(doc, indent=1).encode())
        print(f"fleet-bench: wrote {args.json}", file=sys.stderr)
    else:
        print(markdown(doc))
    _fail_on(doc["failure"], len(doc["runs"]), args.json)
    return 0


def _fail_on(failure: dict[str, str] | None, runs: int, json_path: Path | None) -> None:
    """The command's error when a configuration failed, after what was measured is out."""
    if failure is None:
        return
    kept = f" (the {runs} runs before it are in {json_path})" if json_path else ""
    raise FleetError(f"configuration {failure['config']} failed{kept}: {failure['error']}")
