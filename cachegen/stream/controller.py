"""CacheGen's adaptive quality controller.

Before each chunk is requested, the controller estimates how long the rest of the load
would take at each quality level (bytes still to come over the throughput measured on the
chunks so far, decoding pipelined with the transfer) and picks the finest level (the one
with the most bytes, see :func:`quality_order`) that still fits the time budget (the TTFT
SLO minus the time already spent). When even the smallest level cannot fit, the chunk is
marked ``RECOMPUTE`` if recomputing the remaining tokens from text fits; when nothing fits,
it takes whichever is estimated faster.

Beyond the paper, a level must also be *recoverable*: if the throughput fell by
``drop_factor`` right now, this chunk at that level followed by the rest at the lowest level
(or recomputed, if faster) must still fit. Greedy choice alone spends all the slack and then
misses the SLO on a bandwidth drop; in the trace evaluation (docs/streaming.md) this rule
lifts the SLO hit rate at a small cost in mean level. ``drop_factor=1`` turns it off.

Recomputation is prefix-only, as vLLM's connector interface needs: once a chunk is marked
``RECOMPUTE``, the loader stops and the engine computes that chunk and everything after it.
The time to recompute is ``tokens / prefill_tokens_per_s``, a measured prefill rate of the
model (``cachegen stream-bench`` measures it), so it can be set per model and machine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from cachegen.errors import InputError

RECOMPUTE = "recompute"
DECODE_EWMA = 0.5
DEFAULT_DROP_FACTOR = 3.0  # chosen from the trace evaluation in docs/streaming.md


@dataclass(frozen=True)
class Decision:
    index: int
    choice: int | str  # a level, or RECOMPUTE
    elapsed_s: float
    estimate_mbps: float | None
    estimate_s: float  # estimated time to finish the load with this choice

    def to_dict(self) -> dict:
        return asdict(self)


def quality_order(
    sizes: Mapping[int, Sequence[int | None]], chunk_tokens: Sequence[int]
) -> list[int]:
    """Levels from coarsest to finest, taking a bigger encoding of the same KV as a finer one.

    Level numbers do not order quality once calibrated levels join the paper's presets (on
    SmolLM2, calibrated level 6 is smaller and coarser than calibrated level 4, and level 8
    is smaller than the paper's level 2). Bytes per token over the chunks stored at a level
    do; a level with no stored chunk goes last (it can never be chosen).
    """

    def bytes_per_token(level: int) -> float:
        stored = [
            (size, tokens) for size, tokens in zip(sizes[level], chunk_tokens) if size is not None
        ]
        total_tokens = sum(tokens for _, tokens in stored)
        return sum(size for size, _ in stored) / total_tokens if total_tokens else float("inf")

    return sorted(sizes, key=lambda level: (bytes_per_token(level), level))


class AdaptiveController:
    """Per-chunk level choice under a TTFT budget.

    ``sizes[level][i]`` is the payload size in bytes of chunk ``i`` at ``level`` (e.g. from
    ``store.sizes``); ``chunk_tokens[i]`` its token count. ``decode_s_per_token`` gives prior
    decode costs per level (updated from measurements); ``initial_mbps`` a prior for the
    throughput before the first measurement (without one, chunk 0 goes at the lowest level).
    ``safety`` (<= 1) scales the measured throughput down to leave headroom;
    ``drop_factor`` (>= 1) is the throughput drop a choice must survive (see module docs).
    """

    def __init__(
        self,
        slo_s: float,
        sizes: Mapping[int, Sequence[int | None]],
        chunk_tokens: Sequence[int],
        *,
        prefill_tokens_per_s: float,
        initial_mbps: float | None = None,
        decode_s_per_token: Mapping[int, float] | None = None,
        safety: float = 1.0,
        drop_factor: float = DEFAULT_DROP_FACTOR,
    ) -> None:
        if slo_s <= 0 or prefill_tokens_per_s <= 0 or not 0 < safety <= 1 or drop_factor < 1:
            raise InputError(
                "slo_s and prefill_tokens_per_s must be positive, safety in (0, 1], "
                "drop_factor >= 1"
            )
        if not sizes:
            raise InputError("the controller needs chunk sizes for at least one level")
        self.n = len(chunk_tokens)
        for level in sizes:
            if len(sizes[level]) != self.n:
                raise InputError(f"level {level} has {len(sizes[level])} sizes for {self.n} chunks")
        self.levels = quality_order(sizes, chunk_tokens)
        self.slo_s = slo_s
        self.sizes = {lv: list(sizes[lv]) for lv in self.levels}
        self.tokens = list(chunk_tokens)
        self.prefill_tps = prefill_tokens_per_s
        self.safety = safety
        self.drop_factor = drop_factor
        self._prior = {lv for lv in self.levels if lv in (decode_s_per_token or {})}
        self.decode_spt = {lv: float((decode_s_per_token or {}).get(lv, 0.0)) for lv in self.levels}
        self._observed_decode: set[int] = set()
        self._chosen: dict[int, int] = {}  # chunks chosen and not decoded yet -> level
        self._bps = initial_mbps * 1e6 / 8 if initial_mbps else None
        self.decisions: list[Decision] = []

    # ---- measurements ----------------------------------------------------------------

    def observe_throughput(self, nbytes: int, seconds: float) -> None:
        """A throughput sample (the paper uses the previous chunk's throughput)."""
        if nbytes > 0 and seconds > 0:
            self._bps = nbytes / seconds

    def observe_decode(self, index: int, seconds: float) -> None:
        """Chunk ``index`` (at the level chosen for it) took ``seconds`` to decode."""
        level = self._chosen.pop(index, None)
        if level is None or self.tokens[index] <= 0:
            return
        sample = seconds / self.tokens[index]
        first = level not in self._observed_decode
        self.decode_spt[level] = (
            sample if first else (1 - DECODE_EWMA) * self.decode_spt[level] + DECODE_EWMA * sample
        )
        self._observed_decode.add(level)
        for other in self.levels:  # levels with neither a prior nor a measurement: assume alike
            if other not in self._observed_decode and other not in self._prior:
                self.decode_spt[other] = self.decode_spt[level]

    @property
    def estimate_mbps(self) -> float | None:
        return None if self._bps is None else self._bps * self.safety * 8 / 1e6

    # ---- estimates and choice --------------------------------------------------------

    def _finish_s(
        self, index: int, now: int | str, rest: int | str, bps: float, inflight_bytes: int
    ) -> float:
        """Seconds until the load is done if chunk ``index`` goes at ``now`` and the chunks
        after it at ``rest`` (a level, or RECOMPUTE: the engine computes them afterwards).

        Transfer and decoding overlap: the decoder works through what it already has (chunks
        requested but not decoded yet), then each new chunk; the last one decodes after it
        arrived. Recomputation starts once the loaded prefix is in.
        """
        backlog = sum(self.decode_spt[lv] * self.tokens[j] for j, lv in self._chosen.items())
        chunks = [(index, now)] + [(j, self._stored_as(j, rest)) for j in range(index + 1, self.n)]
        loaded = [(j, lv) for j, lv in chunks if lv != RECOMPUTE]
        if any(self.sizes[lv][j] is None for j, lv in loaded):
            return float("inf")  # not stored at that level
        transfer = (inflight_bytes + sum(self.sizes[lv][j] for j, lv in loaded)) / bps
        decode = backlog + sum(self.decode_spt[lv] * self.tokens[j] for j, lv in loaded)
        last = self.decode_spt[loaded[-1][1]] * self.tokens[loaded[-1][0]] if loaded else 0.0
        recompute = sum(self.tokens[j] for j, lv in chunks if lv == RECOMPUTE) / self.prefill_tps
        return max(transfer + last, decode) + recompute

    def _stored_as(self, index: int, level: int | str) -> int | str:
        """``level`` if chunk ``index`` is stored at it, else the next finer level it is stored
        at (else the next coarser): what a later chunk costs where a store holds only some of
        its levels (a save still writing them)."""
        if level == RECOMPUTE or self.sizes[level][index] is not None:
            return level
        at = self.levels.index(level)
        order = self.levels[at + 1 :] + self.levels[:at][::-1]
        return next((lv for lv in order if self.sizes[lv][index] is not None), level)

    def estimate(self, index: int, choice: int | str, inflight_bytes: int = 0) -> float:
        """Seconds to finish the load from chunk ``index`` on, every chunk at ``choice``."""
        return self._finish_s(index, choice, choice, self._bps * self.safety, inflight_bytes)

    def recoverable(self, index: int, level: int, inflight_bytes: int, budget_s: float) -> bool:
        """Whether chunk ``index`` at ``level`` still leaves a way to finish in ``budget_s`` if
        the throughput fell by ``drop_factor`` now (the rest at the lowest level, or recomputed)."""
        slow = self._bps * self.safety / self.drop_factor
        fallbacks = (self.levels[0], RECOMPUTE)
        return (
            min(self._finish_s(index, level, rest, slow, inflight_bytes) for rest in fallbacks)
            <= budget_s
        )

    def choose(self, index: int, elapsed_s: float, inflight_bytes: int = 0) -> int | str:
        """Level for chunk ``index`` (or RECOMPUTE), ``elapsed_s`` into the load."""
        if self._bps is None:
            available = [lv for lv in self.levels if self.sizes[lv][index] is not None]
            choice: int | str = available[0] if available else RECOMPUTE
            return self._decide(index, choice, elapsed_s, float("nan"))
        budget = self.slo_s - elapsed_s
        estimates = {lv: self.estimate(index, lv, inflight_bytes) for lv in self.levels}
        recompute = self.estimate(index, RECOMPUTE, inflight_bytes)
        fitting = [
            lv
            for lv in self.levels
            if estimates[lv] <= budget and self.recoverable(index, lv, inflight_bytes, budget)
        ]
        if fitting:
            choice, est = fitting[-1], estimates[fitting[-1]]
        else:
            fastest = min(self.levels, key=lambda lv: estimates[lv])
            choice, est = (
                (RECOMPUTE, recompute)
                if recompute <= estimates[fastest]
                else (fastest, estimates[fastest])
            )
        return self._decide(index, choice, elapsed_s, est)

    def _decide(self, index: int, choice: int | str, elapsed_s: float, est: float) -> int | str:
        self.decisions.append(Decision(index, choice, elapsed_s, self.estimate_mbps, est))
        if choice != RECOMPUTE:
            self._chosen[index] = choice  # to be decoded
        return choice
