"""Per-chunk choice of how to load a context: the paper's SLO rule and the fastest form.

Both policies share one prediction (:class:`LoadEstimator`): how long the rest of a load
takes if each chunk goes in a given way, from the bytes still to come over the throughput
measured on the chunks so far, and decoding learned online per choice (seconds per token,
an EWMA seeded by a prior or by the first measurement), decoding pipelined with the
transfer; recomputing from text costs ``tokens / prefill_tokens_per_s``, a measured prefill
rate of the model (``cachegen stream-bench`` measures it).

:class:`AdaptiveController` is CacheGen's rule. Its choices are the quality levels of one
codec; before each chunk it picks the finest level (the one with the most bytes, see
:func:`quality_order`) that still fits the time budget (the TTFT SLO minus the time already
spent). When even the smallest level cannot fit, the chunk is marked ``RECOMPUTE`` if
recomputing the remaining tokens from text fits; when nothing fits, it takes whichever is
estimated faster. Beyond the paper, a level must also be *recoverable*: if the throughput
fell by ``drop_factor`` right now, this chunk at that level followed by the rest at the
lowest level (or recomputed, if faster) must still fit. Greedy choice alone spends all the
slack and then misses the SLO on a bandwidth drop; in the trace evaluation
(docs/streaming.md) this rule lifts the SLO hit rate at a small cost in mean level.
``drop_factor=1`` turns it off.

:class:`FastestController` chooses among stored *forms* (:class:`Option`: a cachegen level
coded or packed, int8, fp8, raw, each with its own record keys) and recomputation: per
chunk, the option allowed by the quality bound (its loss at most ``max_loss_pct``) with the
smallest predicted completion time.

Recomputation is prefix-only, as vLLM's connector interface needs: once a chunk is marked
``RECOMPUTE``, the loader stops and the engine computes that chunk and everything after it.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from cachegen.errors import InputError
from cachegen.modes import RECOMPUTE, Form
from cachegen.store.address import RecordAddress

DECODE_EWMA = 0.5  # weight of a new decode-time sample (the connector's memory across loads too)
DEFAULT_DROP_FACTOR = 3.0  # chosen from the trace evaluation in docs/streaming.md
DEFAULT_EXPLORE = 0.25  # one chunk of a form this close to the fastest costs little
# Switching forms mid-load puts two bottlenecks (one form's transfer, the other's decoding)
# on the same cores, which the prediction does not see: a switch must be predicted this
# much faster than keeping the form.
DEFAULT_SWITCH_MARGIN = 0.1

Choice = Hashable  # a level (AdaptiveController), an option name (FastestController)
# A load whose goodput stayed under this fraction of its link's rate was bounded by the host.
HOST_BOUND = 0.8


def host_bound_mbps(nbytes: int, load_s: float, link_mbps: float | None) -> float | None:
    """The goodput (Mbit/s) of a load of one form that moved ``nbytes`` in ``load_s`` over a
    link of ``link_mbps`` (None: unshaped) if the host, not the link, bounded it: a sample of
    that form's ceiling on this host (``FastestController``'s ``host_mbps``); else None."""
    if load_s <= 0 or nbytes <= 0:
        return None
    goodput = nbytes * 8 / load_s / 1e6
    return goodput if link_mbps is None or goodput < HOST_BOUND * link_mbps else None


@dataclass(frozen=True)
class Decision:
    index: int
    choice: int | str  # a level or an option name, or RECOMPUTE
    elapsed_s: float
    estimate_mbps: float | None
    predicted_s: float  # predicted time to finish the load with this choice

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Option:
    """One stored form a chunk can be loaded in: ``addresses[i]`` names chunk ``i``'s
    record, ``sizes[i]`` its payload bytes (None: not stored), ``loss_pct`` its quality loss
    (None: unknown, never allowed by a bound)."""

    name: str
    addresses: Sequence[RecordAddress]
    sizes: Sequence[int | None]
    loss_pct: float | None

    def within(self, max_loss_pct: float) -> bool:
        """Whether the quality bound ``max_loss_pct`` allows this option."""
        return self.loss_pct is not None and self.loss_pct <= max_loss_pct


def quality_order(
    sizes: Mapping[Choice, Sequence[int | None]], chunk_tokens: Sequence[int]
) -> list:
    """Choices from coarsest to finest, taking a bigger encoding of the same KV as a finer one.

    Level numbers do not order quality once calibrated levels join the paper's presets (on
    SmolLM2, calibrated level 6 is smaller and coarser than calibrated level 4, and level 8
    is smaller than the paper's level 2). Bytes per token over the chunks stored at a level
    do; a level with no stored chunk goes last (it can never be chosen).
    """

    def bytes_per_token(choice: Choice) -> float:
        stored = [
            (size, tokens) for size, tokens in zip(sizes[choice], chunk_tokens) if size is not None
        ]
        total_tokens = sum(tokens for _, tokens in stored)
        return sum(size for size, _ in stored) / total_tokens if total_tokens else float("inf")

    return sorted(sizes, key=lambda choice: (bytes_per_token(choice), choice))


class LoadEstimator:
    """Predicted completion time of a load, learned from its measurements.

    ``sizes[choice][i]`` is the payload size in bytes of chunk ``i`` loaded as ``choice``
    (e.g. from ``store.sizes``); ``chunk_tokens[i]`` its token count. ``decode_s_per_token``
    gives prior decode costs per choice (updated from measurements: a choice's first
    measurement replaces its prior, unless the class sets ``blend_priors``, where it updates
    it like any later one); ``initial_mbps`` a prior for the throughput before the first
    measurement. ``safety`` (<= 1) scales the measured throughput down to leave headroom.
    """

    blend_priors = False

    def __init__(
        self,
        sizes: Mapping[Choice, Sequence[int | None]],
        chunk_tokens: Sequence[int],
        *,
        prefill_tokens_per_s: float,
        initial_mbps: float | None = None,
        decode_s_per_token: Mapping[Choice, float] | None = None,
        safety: float = 1.0,
    ) -> None:
        if prefill_tokens_per_s <= 0 or not 0 < safety <= 1:
            raise InputError("prefill_tokens_per_s must be positive and safety in (0, 1]")
        if not sizes:
            raise InputError("the controller needs chunk sizes for at least one choice")
        self.n = len(chunk_tokens)
        for choice in sizes:
            if len(sizes[choice]) != self.n:
                raise InputError(f"{choice!r} has {len(sizes[choice])} sizes for {self.n} chunks")
        self.order = quality_order(sizes, chunk_tokens)
        self.sizes = {c: list(sizes[c]) for c in self.order}
        self.tokens = list(chunk_tokens)
        self.prefill_tps = prefill_tokens_per_s
        self.safety = safety
        priors = decode_s_per_token or {}
        self._prior = {c for c in self.order if c in priors}
        self.decode_spt = {c: float(priors.get(c, 0.0)) for c in self.order}
        self._observed_decode: set = set()
        self._chosen: dict[int, Choice] = {}  # chunks chosen and not decoded yet -> choice
        self._loaded_as: dict[int, Choice] = {}  # every chunk chosen -> choice
        self._bps = initial_mbps * 1e6 / 8 if initial_mbps else None
        self.decisions: list[Decision] = []

    # ---- measurements ----------------------------------------------------------------

    def observe_throughput(self, nbytes: int, seconds: float, index: int | None = None) -> None:
        """A throughput sample, of chunk ``index`` when known (the paper uses the previous
        chunk's throughput)."""
        if nbytes > 0 and seconds > 0:
            self._bps = nbytes / seconds

    def observe_decode(self, index: int, seconds: float) -> None:
        """Chunk ``index`` (loaded as the choice made for it) took ``seconds`` to decode."""
        choice = self._chosen.pop(index, None)
        if choice is None or self.tokens[index] <= 0:
            return
        sample = seconds / self.tokens[index]
        first = choice not in self._observed_decode
        first = first and not (self.blend_priors and choice in self._prior)
        self.decode_spt[choice] = (
            sample if first else (1 - DECODE_EWMA) * self.decode_spt[choice] + DECODE_EWMA * sample
        )
        self._observed_decode.add(choice)
        for other in self.order:  # choices with neither a prior nor a measurement: assume alike
            if other not in self._observed_decode and other not in self._prior:
                self.decode_spt[other] = self.decode_spt[choice]

    @property
    def estimate_mbps(self) -> float | None:
        return None if self._bps is None else self._bps * self.safety * 8 / 1e6

    # ---- estimates -------------------------------------------------------------------

    def _finish_s(
        self, index: int, now: Choice, rest: Choice, bps: float, inflight_bytes: int
    ) -> float:
        """Seconds until the load is done if chunk ``index`` goes as ``now`` and the chunks
        after it as ``rest`` (or RECOMPUTE: the engine computes them afterwards).

        Transfer and decoding overlap: the decoder works through what it already has (chunks
        requested but not decoded yet), then each new chunk; the last one decodes after it
        arrived. Recomputation starts once the loaded prefix is in.
        """
        backlog = sum(self.decode_spt[c] * self.tokens[j] for j, c in self._chosen.items())
        chunks = [(index, now)] + [(j, self._stored_as(j, rest)) for j in range(index + 1, self.n)]
        loaded = [(j, c) for j, c in chunks if c != RECOMPUTE]
        if any(self.sizes[c][j] is None for j, c in loaded):
            return float("inf")  # not stored that way
        transfer = inflight_bytes / bps + sum(self._transfer_s(j, c, bps) for j, c in loaded)
        decode = backlog + sum(self.decode_spt[c] * self.tokens[j] for j, c in loaded)
        last = self.decode_spt[loaded[-1][1]] * self.tokens[loaded[-1][0]] if loaded else 0.0
        recompute = sum(self.tokens[j] for j, c in chunks if c == RECOMPUTE) / self.prefill_tps
        return max(transfer + last, decode) + recompute

    def _transfer_s(self, index: int, choice: Choice, bps: float) -> float:
        """Seconds to move chunk ``index`` as ``choice`` at ``bps``."""
        return self.sizes[choice][index] / bps

    def _stored_as(self, index: int, choice: Choice) -> Choice:
        """``choice`` if chunk ``index`` is stored that way, else the next finer one it is
        stored as (else the next coarser): what a later chunk costs where a store holds only
        some of them (a save still writing them)."""
        if choice == RECOMPUTE or self.sizes[choice][index] is not None:
            return choice
        at = self.order.index(choice)
        order = self.order[at + 1 :] + self.order[:at][::-1]
        return next((c for c in order if self.sizes[c][index] is not None), choice)

    def estimate(self, index: int, choice: Choice, inflight_bytes: int = 0) -> float:
        """Seconds to finish the load from chunk ``index`` on, every chunk as ``choice``."""
        return self._finish_s(index, choice, choice, self._bps * self.safety, inflight_bytes)

    def _first_stored(self, index: int, order: Sequence[Choice]) -> Choice:
        """The first of ``order`` that chunk ``index`` is stored as (RECOMPUTE: none)."""
        return next((c for c in order if self.sizes[c][index] is not None), RECOMPUTE)

    def record(self, index: int, choice: Choice, address: RecordAddress) -> RecordAddress:
        """The record of chunk ``index`` loaded as ``choice``, a level of the codec of
        ``address`` (the loader's record of the chunk), coded, or a form's name."""
        if isinstance(choice, str):
            return address.with_form(Form.parse(choice))
        return address.with_form(Form(address.form.codec, int(choice)))

    def _decide(self, index: int, choice: Choice, elapsed_s: float, predicted: float) -> Choice:
        self.decisions.append(Decision(index, choice, elapsed_s, self.estimate_mbps, predicted))
        if choice != RECOMPUTE:
            self._chosen[index] = choice  # to be decoded
            self._loaded_as[index] = choice
        return choice


class AdaptiveController(LoadEstimator):
    """Per-chunk level choice under a TTFT budget (the paper's rule, see module docs).

    ``sizes[level][i]`` is the payload size of chunk ``i`` at ``level``; without a throughput
    prior (``initial_mbps``), chunk 0 goes at the lowest level. ``drop_factor`` (>= 1) is the
    throughput drop a choice must survive. Other arguments: :class:`LoadEstimator`.
    """

    def __init__(
        self,
        slo_s: float,
        sizes: Mapping[int, Sequence[int | None]],
        chunk_tokens: Sequence[int],
        *,
        drop_factor: float = DEFAULT_DROP_FACTOR,
        **estimator: Any,
    ) -> None:
        if slo_s <= 0 or drop_factor < 1:
            raise InputError("slo_s must be positive and drop_factor >= 1")
        super().__init__(sizes, chunk_tokens, **estimator)
        self.slo_s = slo_s
        self.drop_factor = drop_factor

    @property
    def levels(self) -> list[int]:
        """The levels from coarsest to finest."""
        return self.order

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
            choice = self._first_stored(index, self.levels)
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


class FastestController(LoadEstimator):
    """Per-chunk choice of the stored form (or recomputation) predicted to finish the load
    soonest, among the ``options`` whose ``loss_pct`` is at most ``max_loss_pct``.

    ``decode_s_per_token`` holds priors per option name; ``host_mbps`` per option name the
    highest rate at which this host has received that form in earlier loads (its ceiling when
    the host, not the link, bounds the transfer: the receiving thread's copies and checksums
    share the cores with the decoder, and a big form hits that ceiling first); a form's bytes
    are predicted to arrive at the lower of the link's rate and its ceiling (a form without
    one, never host-bound so far, at the link's rate). Without a
    throughput prior (``initial_mbps``), chunk 0 goes in the smallest allowed form. A prior is
    only a guess at how fast a form decodes during this load: once the fastest option's
    decoding has been measured, an option predicted within ``explore`` (a fraction) of it
    whose decoding has not been goes once, in the first half of the load, so that its
    measurement, not its prior alone, decides (0: never). A chunk keeps the form of the
    chunk before it unless another is predicted to finish the load at least
    ``switch_margin`` (a fraction) sooner (0: always the fastest predicted). Other arguments:
    :class:`LoadEstimator`.
    """

    # Its priors are forms' measured decode rates: one sample (a load's first chunk often
    # decodes slower) must not replace them.
    blend_priors = True

    def __init__(
        self,
        options: Sequence[Option],
        chunk_tokens: Sequence[int],
        *,
        max_loss_pct: float,
        explore: float = DEFAULT_EXPLORE,
        switch_margin: float = DEFAULT_SWITCH_MARGIN,
        host_mbps: Mapping[str, float] | None = None,
        **estimator: Any,
    ) -> None:
        if explore < 0 or switch_margin < 0:
            raise InputError(
                f"explore and switch_margin must be >= 0, got {explore} and {switch_margin}"
            )
        if any(not rate > 0 for rate in (host_mbps or {}).values()):
            raise InputError(f"host_mbps must be positive rates: {dict(host_mbps or {})}")
        self.explore = explore
        self.switch_margin = switch_margin
        self._host_bps = {name: rate * 1e6 / 8 for name, rate in (host_mbps or {}).items()}
        names = [o.name for o in options]
        if len(set(names)) != len(names) or RECOMPUTE in names:
            raise InputError(f"option names must be distinct and not {RECOMPUTE!r}: {names}")
        for o in options:
            if len(o.addresses) != len(chunk_tokens):
                raise InputError(
                    f"{o.name} has {len(o.addresses)} records for {len(chunk_tokens)} chunks"
                )
        self.options = {o.name: o for o in options}
        self.max_loss_pct = max_loss_pct
        allowed = [o for o in options if o.within(max_loss_pct)]
        if not allowed:
            known = {o.name: o.loss_pct for o in options}
            raise InputError(
                f"no option has a loss of at most {max_loss_pct}% (losses: {known}); raise the "
                "bound or give the options' losses"
            )
        super().__init__({o.name: o.sizes for o in allowed}, chunk_tokens, **estimator)
        self._sampled_bytes = 0
        self._sampled_s = 0.0
        self._sampled_by_option: dict[Choice, tuple[int, float]] = {}

    def observe_throughput(self, nbytes: int, seconds: float, index: int | None = None) -> None:
        """The rate is all samples' bytes over all their seconds, not the last sample's: bytes
        that waited in socket buffers while the decoder was behind read far faster than the
        link carries them, and this way they weigh only the little time they took. The
        samples of chunk ``index`` also count for the option it is loaded as: where the host
        bounds the transfer, a bigger form moves slower than a smaller one."""
        if nbytes > 0 and seconds > 0:
            self._sampled_bytes += nbytes
            self._sampled_s += seconds
            self._bps = self._sampled_bytes / self._sampled_s
            option = self._loaded_as.get(index) if index is not None else None
            if option is not None:
                got, took = self._sampled_by_option.get(option, (0, 0.0))
                self._sampled_by_option[option] = (got + nbytes, took + seconds)

    def _transfer_s(self, index: int, choice: Choice, bps: float) -> float:
        """At the option's own measured rate once it has one, and never above the host's
        ceiling for it."""
        if choice in self._sampled_by_option:
            got, took = self._sampled_by_option[choice]
            bps = got / took * self.safety
        if choice in self._host_bps:
            bps = min(bps, self._host_bps[choice])
        return self.sizes[choice][index] / bps

    @property
    def allowed(self) -> list[str]:
        """The allowed option names, smallest first."""
        return self.order

    def record(self, index: int, choice: Choice, address: RecordAddress) -> RecordAddress:
        return self.options[str(choice)].addresses[index]

    def choose(self, index: int, elapsed_s: float, inflight_bytes: int = 0) -> str:
        """Option name for chunk ``index`` (or RECOMPUTE), ``elapsed_s`` into the load."""
        if self._bps is None:
            choice = self._first_stored(index, self.allowed)
            return self._decide(index, choice, elapsed_s, float("nan"))
        predicted = {c: self.estimate(index, c, inflight_bytes) for c in self.allowed}
        predicted[RECOMPUTE] = self.estimate(index, RECOMPUTE, inflight_bytes)
        # ties: the smaller form (allowed is ordered by size), recomputation last
        fastest = min(predicted, key=predicted.get)
        trials = [
            c
            for c in sorted(predicted, key=predicted.get)
            if self._worth_trying(c, predicted, fastest)
        ]
        # a trial pays off in the chunks after it: none in the second half of the load
        trying = trials and fastest in self._observed_decode and index < self.n // 2
        choice = trials[0] if trying else self._keep_or_switch(index, predicted, fastest)
        return self._decide(index, choice, elapsed_s, predicted[choice])

    def _keep_or_switch(self, index: int, predicted: Mapping[str, float], fastest: str) -> str:
        """The previous chunk's form if it is predicted within ``switch_margin`` of
        ``fastest`` (and chunk ``index`` is stored that way), else ``fastest``."""
        previous = self._loaded_as.get(index - 1)
        if previous is None or self.sizes[previous][index] is None:
            return fastest
        keep = predicted[previous] <= (1 + self.switch_margin) * predicted[fastest]
        return previous if keep else fastest

    def _worth_trying(self, option: str, predicted: Mapping[str, float], best: str) -> bool:
        """Whether ``option`` has never been decoded (nor waits to be) in this load and is
        predicted within ``explore`` of ``best``."""
        return (
            option not in (RECOMPUTE, best)
            and option not in self._observed_decode
            and option not in self._chosen.values()
            and predicted[option] <= (1 + self.explore) * predicted[best]
        )
