"""Worker side of the connector: inject fetched KV into vLLM's paged cache, and copy a finished
prefill's KV out of it for saving.

Where the work runs (chosen by measurement, see docs/connector.md "Where the work runs"):
  * loads (``load_async``, default): background threads (``load_threads``: a slow load holds
    only its own) stream, decode and inject, each within ``load_timeout_s``, while
    vLLM keeps stepping the other requests; the request waits in vLLM's
    WAITING_FOR_REMOTE_KVS state and is released through ``get_finished``. Inline loads
    (``load_async=false``) run in ``start_load_kv`` before the forward pass and stall every
    other request for the whole transfer.
  * saves (``save_async``, default): the prompt's KV is copied out of the paged cache inside
    ``wait_for_save`` (a memory copy) and a background thread encodes and stores it, so the
    request's first token does not wait for the encoder or the store. The thread writes the
    first pass of every queued save (each chunk at the levels that make it loadable, in prefix
    order) before any save's other levels, and pauses while a load runs in this worker; the
    scheduler hears which saves finished their first pass (``LoadReports.saved``) and holds
    back a request whose leading chunks are still in one (``save_wait_ms``).
  * with tensor parallelism, every rank reads its heads of a saved prompt and the first rank
    gathers them and alone stores the model's KV; every rank loads whole chunks and writes its
    own heads (cachegen/connector/head_shards.py).
  * not layer by layer: a CacheGen chunk carries all layers of its tokens, so the first layer
    is complete only when the last chunk is decoded; per-layer hand-off would gain nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cachegen.connector.head_shards import HeadExchange, Heads, HeadShard
from cachegen.connector.loader import Loader
from cachegen.connector.metadata import LoadReports, LoadTask, SaveTask, StepMetadata
from cachegen.connector.paged_cache import CacheGroup, PagedCache
from cachegen.connector.save_plan import SavePrefix, SaveRecord
from cachegen.connector.stats import StatsRecorder
from cachegen.connector.writer import ChunkWriter
from cachegen.kv import KVCache, ModelIdentity

logger = logging.getLogger(__name__)

SAVE_QUEUE_DEPTH = 4  # prompts held for saving; more are dropped (a cache may miss)
SAVE_YIELD_S = 1.0  # longest a save waits, per record, for the loads running in this worker
SAVE_IDLE_WAIT_S = 0.02  # longest wait of an idle engine step for a save's first pass
RATE_MIN_TOKENS = 256  # steps with fewer tokens say little about the prefill rate
RATE_EWMA = 0.5
IDLE_WAIT_S = 0.005  # longest wait of an idle engine step for a background load to finish


class _Background:
    """``threads`` daemon threads running queued jobs in their order; ``pending`` counts
    unfinished jobs."""

    def __init__(self, name: str, threads: int = 1) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Callable[[], None]) -> bool:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            return False
        return True

    @property
    def pending(self) -> int:
        return self._jobs.unfinished_tasks

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                job()
            except Exception:  # noqa: BLE001 - jobs report their own failures; the thread must live
                logger.exception("cachegen connector background job failed")
            finally:
                self._jobs.task_done()

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        for thread in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()) + 1)


@dataclass(eq=False)
class _SaveJob:
    """One prompt's save: its KV until the saver thread plans it, then the records of its first
    pass and the rest (``ChunkWriter.save_records``)."""

    task: SaveTask
    kv: KVCache | None
    first: deque[SaveRecord] = field(default_factory=deque)
    rest: deque[SaveRecord] = field(default_factory=deque)
    written: int = 0
    started: float = field(default_factory=time.perf_counter)
    first_pass_reported: bool = False


class _Saver:
    """One daemon thread writing save jobs a record at a time: the first pass of every queued job
    before any job's other levels (a repeat of a prompt needs its chunks loadable, not every
    level), and each record of the other levels after ``wait_loads`` (a load in this worker
    goes first, for at most ``SAVE_YIELD_S``). ``on_first_pass(job)`` runs once per job, when
    its first pass is stored or the job is given up; at most ``depth`` jobs are held (with
    their KV)."""

    def __init__(
        self,
        plan: Callable[[SaveTask, KVCache], list[SaveRecord]],
        write: Callable[[SaveRecord], int],
        wait_loads: Callable[[float], None],
        on_first_pass: Callable[[_SaveJob], None],
        depth: int,
    ) -> None:
        self._plan, self._write = plan, write
        self._wait_loads, self._on_first_pass = wait_loads, on_first_pass
        self._depth = depth
        self._cond = threading.Condition()
        self._first: deque[_SaveJob] = deque()  # first pass not done, oldest first
        self._rest: deque[_SaveJob] = deque()  # first pass done, other levels to write
        self._busy = False  # a record is being written
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="cachegen-save", daemon=True)
        self._thread.start()

    def submit(self, job: _SaveJob) -> bool:
        """Queue ``job``; when ``depth`` jobs are held, the oldest job's other levels make
        room (its chunks are loadable already), else ``job`` is refused (False)."""
        dropped = None
        with self._cond:
            if len(self._first) + len(self._rest) >= self._depth:
                if not self._rest:
                    return False
                dropped = self._rest.popleft()
            self._first.append(job)
            self._cond.notify_all()
        if dropped is not None:
            logger.warning(
                "request %s: save queue full, storing only the first level of its chunks",
                dropped.task.req_id,
            )
        return True

    def _take(self) -> tuple[_SaveJob, SaveRecord]:
        """The next record to write (the lock is held): the oldest first pass's, else the
        oldest other levels'."""
        from_first = bool(self._first)
        jobs = self._first if from_first else self._rest
        job = jobs[0]
        records = job.first if from_first else job.rest
        record = records.popleft()
        if not records:
            jobs.popleft()
            if from_first and job.rest:
                self._rest.append(job)
        return job, record

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._first or self._rest or self._closing)
                if not (self._first or self._rest):
                    return
                head = self._first[0] if self._first else None
            if head is None:  # other levels; a request may be held back for a first pass
                self._wait_loads(SAVE_YIELD_S)
            elif head.kv is not None and not self._planned(head):
                continue
            with self._cond:
                if not (self._first or self._rest) or (
                    self._first and self._first[0].kv is not None
                ):
                    continue  # nothing left, or a new first pass to plan
                job, record = self._take()
                self._busy = True
            try:
                job.written += self._write(record)
            except Exception:  # noqa: BLE001 - a failed save is a future cache miss, never a crash
                logger.exception("request %s: storing its KV failed", job.task.req_id)
                self._give_up(job)
            else:
                if record.first and not job.first:
                    self._first_pass_over(job)
                if not job.first and not job.rest:
                    logger.debug(
                        "request %s: stored %d bytes in %.3f s",
                        job.task.req_id,
                        job.written,
                        time.perf_counter() - job.started,
                    )
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _planned(self, job: _SaveJob) -> bool:
        """Turn ``job``'s KV into its records (here, not in the engine step: the first use of a
        codec builds it); False when that failed and the job was given up."""
        try:
            records = self._plan(job.task, job.kv)
        except Exception:  # noqa: BLE001 - a failed save is a future cache miss, never a crash
            logger.exception("request %s: planning its save failed", job.task.req_id)
            records = []
        job.kv = None
        job.first.extend(r for r in records if r.first)
        job.rest.extend(r for r in records if not r.first)
        if not job.first:
            self._give_up(job)
            return False
        return True

    def _first_pass_over(self, job: _SaveJob) -> None:
        if not job.first_pass_reported:
            job.first_pass_reported = True
            self._on_first_pass(job)

    def _give_up(self, job: _SaveJob) -> None:
        with self._cond:
            for jobs in (self._first, self._rest):
                if job in jobs:
                    jobs.remove(job)
            job.first.clear()
            job.rest.clear()
        self._first_pass_over(job)

    def close(self, timeout: float) -> None:
        """Finish the queued jobs for at most ``timeout`` seconds, then drop the rest."""
        with self._cond:
            self._cond.wait_for(
                lambda: not (self._first or self._rest or self._busy), timeout=timeout
            )
            left = list(self._first)
            self._first.clear()
            self._rest.clear()
            self._closing = True
            self._cond.notify_all()
        for job in left:
            self._first_pass_over(job)
        self._thread.join(timeout=1)


class WorkerSide:
    def __init__(
        self,
        loader: Loader,
        writer: ChunkWriter,
        close: Callable[[], None],  # releases the store and codecs the two share
        model: ModelIdentity,
        groups: list[CacheGroup],
        chunk_tokens: int,
        *,
        save_async: bool,
        load_threads: int = 1,
        windows: tuple[int | None, ...] | None = None,
        exchange: HeadExchange | None = None,
    ) -> None:
        self.loader = loader
        self.writer = writer
        self._close = close
        self.exchange = exchange or HeadExchange(HeadShard(0, 1, model.num_kv_heads))
        self.cache = PagedCache(model, groups, windows, self.exchange.shard)
        self.chunk_tokens = chunk_tokens
        self._lock = threading.Lock()  # guards the collections below (loader thread)
        self._progress = threading.Condition(self._lock)  # a load or a save's first pass ended
        self._in_flight = 0  # loads submitted and not finished (background or inline)
        self._saving: set[int] = set()  # save ids whose first pass is not stored yet
        self._saved: list[int] = []  # save ids whose first pass ended, not reported yet
        self._invalid_blocks: set[int] = set()
        self._failed_loads: set[str] = set()  # loads that failed (several KV cache groups)
        self._reports: dict[str, dict[str, Any]] = {}
        self._finished_loads: set[str] = set()
        self._failed_inline: set[str] = set()
        self._loader = _Background("cachegen-load", load_threads)
        self.stats = StatsRecorder()  # saves (the scheduler side counts lookups and loads)
        stores = self.exchange.shard.is_leader  # with tensor parallelism, the first rank stores
        self._saver = (
            _Saver(
                self._save_records,
                self._write,
                self._wait_for_loads,
                self._first_pass_over,
                SAVE_QUEUE_DEPTH,
            )
            if save_async and stores
            else None
        )
        self._step_started = 0.0
        self.prefill_tokens_per_s: float | None = None  # measured on this engine's prefill steps

    def register(self, kv_caches: dict[str, torch.Tensor], layers: dict[str, Any]) -> None:
        self.cache.register(kv_caches, layers)

    # ---- loads ---------------------------------------------------------------------------------

    def step_started(self) -> None:
        self._step_started = time.perf_counter()

    def start_loads(self, meta: StepMetadata) -> None:
        for task in meta.loads:
            with self._lock:
                self._in_flight += 1
            if task.in_background:
                self._loader.submit(lambda task=task: self._load(task))
            else:
                self._load(task)

    def _load(self, task: LoadTask) -> None:
        """Run the task's plan: fetch -> decode -> check -> inject into its blocks."""
        t0 = time.perf_counter()
        plan = task.plan
        first = plan.begin // self.chunk_tokens
        count = -(-plan.end // self.chunk_tokens) - first
        inject = _TimedInject(self.cache, task.block_ids, plan.begin, plan.end)
        try:
            result = self.loader.run(plan, inject, self.prefill_tokens_per_s, self.cache.dtype)
            error, done_chunks, stats = result.error, result.chunks_loaded, result.stats
        except Exception as exc:  # noqa: BLE001 - any failure of a load must become a recompute
            logger.exception("request %s: KV load failed", task.req_id)
            error, done_chunks, stats = f"{type(exc).__name__}: {exc}", 0, {}
        loaded_end = max(plan.begin, min(plan.end, (first + done_chunks) * self.chunk_tokens))
        if error is None and loaded_end < plan.end:
            error = f"only {done_chunks} of {count} chunks arrived"
        report = {
            **stats,
            "loaded_tokens": loaded_end - plan.begin,
            "chunks": done_chunks,
            "inject_s": inject.seconds,
            "load_s": time.perf_counter() - t0,
        }
        with self._lock:
            if error is not None:
                report["load_error"] = error
                self._mark_failed(task, loaded_end)
                if not task.in_background:
                    self._failed_inline.add(task.req_id)
            self._reports[task.req_id] = report
            if task.in_background:
                self._finished_loads.add(task.req_id)
            self._in_flight -= 1
            self._progress.notify_all()
        if error is not None:
            logger.warning(
                "request %s: loaded %d of %d tokens; vLLM recomputes the rest (all of the "
                "request with several KV cache groups): %s",
                task.req_id,
                loaded_end - plan.begin,
                plan.end - plan.begin,
                error,
            )

    def _mark_failed(self, task: LoadTask, loaded_end: int) -> None:
        """Tell vLLM (kv_load_failure_policy="recompute") what to recompute: with one KV cache
        group, from the first block that failed; with several, the whole request (block ids
        are per group there, and vLLM cannot map them back to requests)."""
        groups = self.cache.groups
        if len(groups) > 1:
            self._failed_loads.add(task.req_id)
            return
        size = groups[0].block_size
        end = task.plan.end
        self._invalid_blocks.update(task.block_ids[0][loaded_end // size : -(-end // size)])

    def finished_loads(self, idle: bool) -> tuple[set[str], set[str]]:
        """Background loads done since the last call, and those of them that failed with
        several KV cache groups (with one, their failed blocks are reported with them).

        ``idle``: vLLM had nothing to compute this step. It then steps again at once, only to
        ask whether a load finished (or, for a request the scheduler holds back, whether a
        save's first pass did); waiting here a few milliseconds (woken the moment one ends)
        keeps that loop from spinning and taking the CPU from the loader and saver threads.
        """
        with self._lock:
            if idle and not (self._finished_loads or self._saved):
                if self._in_flight:
                    self._progress.wait(timeout=IDLE_WAIT_S)
                elif self._saving:
                    self._progress.wait(timeout=SAVE_IDLE_WAIT_S)
            done, self._finished_loads = self._finished_loads, set()
            failed = self._failed_loads & done
            self._failed_loads -= failed
        return done, failed

    def block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def take_reports(self) -> LoadReports | None:
        with self._lock:
            reports, self._reports = self._reports, {}
            saved, self._saved = self._saved, []
        return LoadReports(reports, saved) if reports or saved else None

    # ---- saves ---------------------------------------------------------------------------------

    def _measure_step(self, meta: StepMetadata) -> None:
        """Prefill rate from steps that computed many tokens and loaded nothing."""
        if meta.loads or meta.step_tokens < RATE_MIN_TOKENS or not self._step_started:
            return
        seconds = time.perf_counter() - self._step_started
        if seconds > 0:
            sample = meta.step_tokens / seconds
            rate = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = (
                sample if rate is None else (1 - RATE_EWMA) * rate + RATE_EWMA * sample
            )

    def submit_saves(self, meta: StepMetadata) -> None:
        self._measure_step(meta)
        with self._lock:
            failed, self._failed_inline = self._failed_inline, set()
        if not meta.saves:
            return
        # A request whose inline load failed is not saved: vLLM recomputes what its cache holds.
        reads = [None if task.req_id in failed else self._read(task) for task in meta.saves]
        wholes = self.exchange.whole(reads)
        if not self.exchange.shard.is_leader:
            return
        for task, heads in zip(meta.saves, wholes, strict=True):
            self._submit_save(task, heads)

    def _submit_save(self, task: SaveTask, heads: Heads | None) -> None:
        """Save ``task`` from its KV ``heads``; a save that cannot start ends its first pass
        at once, so that no request waits for it."""
        try:
            if heads is None:
                self._first_pass_ended(task.save_id)
                return
            kv = self.cache.as_kv(heads, task.token_ids, task.first_chunk * self.chunk_tokens)
        except Exception:  # noqa: BLE001 - a failed save is a future cache miss, never a crash
            logger.exception("request %s: preparing its save failed", task.req_id)
            self._first_pass_ended(task.save_id)
            return
        with self._lock:
            self._saving.add(task.save_id)
        if self._saver is None:
            self._save(task, kv)
        elif not self._saver.submit(_SaveJob(task, kv)):
            logger.warning("request %s: save queue full, not storing this prefix", task.req_id)
            self._first_pass_ended(task.save_id)
            return
        for mode in task.modes:  # a save that runs (inline or queued)
            self.stats.count("saves", mode)

    def _read(self, task: SaveTask) -> Heads | None:
        """This rank's heads of the prompt to save, or None when reading them failed."""
        begin = task.first_chunk * self.chunk_tokens
        try:
            return self.cache.read(task.block_ids, begin, len(task.token_ids))
        except Exception:  # noqa: BLE001 - a failed save is a future cache miss, never a crash
            logger.exception("request %s: reading its KV for saving failed", task.req_id)
            return None

    def _write(self, record: SaveRecord) -> int:
        written = self.writer.write(record)
        if written:
            self.stats.count("saved_bytes", record.address.form.codec, written)
        return written

    def _save_records(self, task: SaveTask, kv: KVCache) -> list[SaveRecord]:
        prefix = SavePrefix(task.token_ids, task.modes, task.sliding_from, task.salt)
        return self.writer.save_records(prefix, kv)

    def _save(self, task: SaveTask, kv: KVCache) -> None:
        """Store ``kv`` inside this engine step (``save_async=false``)."""
        t0 = time.perf_counter()
        try:
            records = self._save_records(task, kv)
            nbytes = sum(self._write(record) for record in records)
        except Exception:  # noqa: BLE001 - a failed save is a future cache miss, never a crash
            logger.exception("request %s: storing its KV failed", task.req_id)
            nbytes = 0
        self._first_pass_ended(task.save_id)
        logger.debug(
            "request %s: stored %d bytes in %.3f s", task.req_id, nbytes, time.perf_counter() - t0
        )

    def _first_pass_over(self, job: _SaveJob) -> None:
        self._first_pass_ended(job.task.save_id)

    def _first_pass_ended(self, save_id: int) -> None:
        """Tell the scheduler (next report) that save ``save_id`` stored its first pass, or
        never will: it stops holding back requests for it."""
        with self._lock:
            self._saving.discard(save_id)
            self._saved.append(save_id)
            self._progress.notify_all()

    def _wait_for_loads(self, timeout: float) -> None:
        """Return when no load runs in this worker, or after ``timeout`` seconds."""
        with self._lock:
            self._progress.wait_for(lambda: not self._in_flight, timeout=timeout)

    def shutdown(self) -> None:
        self._loader.close(timeout=30)
        if self._saver is not None:
            self._saver.close(timeout=60)
        self.loader.close()
        self._close()


class _TimedInject:
    """Writes each decoded record into a request's blocks (tokens ``[begin, end)`` of it),
    counting the seconds spent."""

    def __init__(self, cache: PagedCache, block_ids: list[list[int]], begin: int, end: int):
        self.cache, self.block_ids, self.begin, self.end = cache, block_ids, begin, end
        self.seconds = 0.0

    def __call__(self, kv: KVCache) -> None:
        t = time.perf_counter()
        self.cache.inject(self.block_ids, kv, self.begin, self.end)
        self.seconds += time.perf_counter() - t
