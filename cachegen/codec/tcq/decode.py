"""The ``tcq`` decoder: frame bodies (layout in :mod:`cachegen.codec.tcq.codec`) back into KV.

A frame decodes in three passes over its (layer, K/V) streams (:mod:`cachegen.codec.tcq.kernels`):
rANS symbols into coefficients, one batched product with the synthesis matrices (in the
arithmetic :func:`synthesis_arithmetic` picks for the CPU), then the channel means added and keys
turned into the output. The int16 arithmetic does the last two in one pass
(:mod:`cachegen.codec.tcq.int_synthesis`), and without a prediction chain each codec thread runs a
stream's product right after its symbols, while they are still in cache, and the threads take
the streams of a few frames in one hand-out (:meth:`TcqDecoder.decode`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cachegen.codec.base import FrameDecoder
from cachegen.codec.coding import rans
from cachegen.codec.coding.bitstream import Frame, Header
from cachegen.codec.coding.parallel import run_batches, run_jobs
from cachegen.codec.errors import CodecError
from cachegen.codec.tcq import int_synthesis
from cachegen.codec.tcq import kernels as tcq_kernels
from cachegen.codec.tcq.code import (
    OFFSET_UNITS,
    LevelCode,
    StreamTables,
    exact_count,
    table_rows,
)
from cachegen.codec.tcq.model import TcqModel
from cachegen.codec.tcq.predict import LayerPredictor, apply_predictions
from cachegen.codec.tcq.refine import (
    RefinedRows,
    Refinement,
    read_refined,
    read_refinement,
)
from cachegen.codec.transform.packing import inflate_exactly
from cachegen.codec.transform.rotary import rotary_tables


@functools.cache
def bf16_synthesis() -> bool:
    """Whether a bfloat16 GEMM runs natively here: on CPUs with bfloat16 matrix instructions
    (AMX or AVX512-BF16), where it runs several times faster than float32 and rounds the
    synthesis entries and the product to bfloat16, far below the quantizer's error
    (docs/codec.md, tcq's "Decode speed"). Elsewhere bfloat16 GEMMs are emulated and slower.
    (torch names these CPU probes with a leading underscore; a torch without them reads as
    neither.)"""
    return _cpu_has("_is_amx_tile_supported") or _cpu_has("_is_avx512_bf16_supported")


@functools.cache
def amx_synthesis() -> bool:
    """Whether the bfloat16 GEMM beats the int16 kernel: with AMX tiles. With AVX512-BF16
    alone the int16 kernel measured faster (docs/codec.md, "The product in integers")."""
    return _cpu_has("_is_amx_tile_supported")


def _cpu_has(probe: str) -> bool:
    return bool(getattr(torch.cpu, probe, lambda: False)())


def int16_synthesis() -> bool:
    """Whether the product can run in integers (:mod:`cachegen.codec.tcq.int_synthesis`: the
    kernel was built and the CPU has AVX2 and FMA), faster than float32 there (docs/codec.md,
    "The product in integers")."""
    return int_synthesis.available()


BF16, INT16, FLOAT32 = "bf16", "int16", "float32"
# the coefficients' scratch of one hand-out of fused frames (TcqDecoder.decode): a few frames
_HANDOUT_SCRATCH = 32 << 20
# per arithmetic: the coefficients' dtype and the product rows' dtype
_DTYPES: dict[str, tuple[torch.dtype, torch.dtype | None]] = {
    BF16: (torch.bfloat16, torch.bfloat16),
    INT16: (torch.int16, None),  # no rows: the kernel writes the output
    FLOAT32: (torch.float32, torch.float32),
}


def synthesis_arithmetic(out_dtype: torch.dtype, width: int, head_dim: int) -> str:
    """The synthesis product's arithmetic for output ``out_dtype``, ``width`` kept rows and
    ``head_dim``: bf16 for bf16 output where the CPU has AMX, else int16 where the kernel runs
    and takes the shape (:func:`int_synthesis.fits`), else bf16 for bf16 output where the CPU
    has any bf16 matrix instructions, else float32."""
    bf16 = out_dtype == torch.bfloat16 and bf16_synthesis()
    int16 = int16_synthesis() and int_synthesis.fits(width, head_dim)
    if bf16 and (amx_synthesis() or not int16):
        return BF16
    return INT16 if int16 else FLOAT32


@dataclass
class _Layout:
    """Where a frame body's parts are: exact tokens, choices (adaptive frames), streams."""

    exact_tokens: int
    exact_bytes: int
    side_bytes: int  # the choices' bytes, their length word included
    words: np.ndarray  # word count of each stream
    offsets: np.ndarray | None = None  # int8 per kept component (adaptive frames)
    choices: np.ndarray | None = None  # uint8 per kept component (adaptive frames)
    refinement: Refinement | None = None  # refined frames with refined rows


@dataclass
class SymbolPass:
    """A frame's symbol pass: ``kernel(todo)`` decodes streams ``todo`` (``work``: each
    stream's relative cost), then ``verify()`` raises ``CodecError`` if one was corrupt."""

    kernel: Callable[[np.ndarray], None]
    work: np.ndarray
    verify: Callable[[], None]


class TcqDecoder(FrameDecoder):
    def __init__(
        self,
        header: Header,
        tcq: TcqModel,
        code: LevelCode,
        adaptive: bool,
        predicted: bool = False,
        refined: bool = False,
    ) -> None:
        super().__init__(header)
        self.tcq = tcq
        self.code = code
        self.adaptive = adaptive
        self.refined = refined
        self.layers = list(header.layer_indices)
        self.streams = code.stream_tables(tcq, tuple(self.layers), predicted)
        # the layers whose frames code residuals of a prediction from the layer before
        self.predicted = code.predicted_layers(tuple(self.layers)) if predicted else []
        self.thetas = [tcq.rope_thetas[layer] for layer in self.layers]
        self.synthesis = _Synthesis(self.streams, self.predicted, header.num_kv_heads)
        # per frame of a hand-out: (tokens, dtypes) -> (coefficients, rows)
        self._scratch: dict[int, tuple[tuple, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._checked: dict[int, tuple[object, _Layout]] = {}  # frame index -> (body, layout)

    def _scratch_for(
        self, slot: int, tokens: int, dtype: torch.dtype, row_dtype: torch.dtype | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Coefficients [streams, tokens, width] (``dtype``) and rows [streams, tokens,
        channels] (the synthesis's ``row_dtype``; None: no rows) of the ``slot``-th frame of a
        hand-out, kept for the next frame of the same length: fresh pages cost as much as
        filling them."""
        shape = (tokens, dtype, row_dtype)
        kept = self._scratch.get(slot)
        if kept is None or kept[0] != shape:
            streams, channels = self.streams, self.streams.synthesis.shape[2]
            count = len(streams.kept)
            coefficients = torch.empty((count, tokens, streams.width), dtype=dtype)
            rows = torch.empty((count, tokens, channels) if row_dtype else 0, dtype=row_dtype)
            self._scratch[slot] = kept = (shape, (coefficients, rows))
        return kept[1]

    def _frame_start(self, frame: Frame) -> int:
        return self.header.start + frame.index * self.header.chunk_tokens

    def _choices(self, frame: Frame, at: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(bytes, offsets, table choices) of an adaptive frame's choices at byte ``at``."""
        body, where = frame.body, f"frame {frame.index} is corrupt: tcq"
        if len(body) < at + 4:
            raise CodecError(f"{where} body is {len(body)} bytes, too short for its choices")
        (size,) = np.frombuffer(body, dtype="<u4", count=1, offset=at)
        if at + 4 + int(size) > len(body):
            raise CodecError(f"{where} choices run past the body")
        kept = int(self.streams.kept.sum())
        raw = inflate_exactly(
            body[at + 4 : at + 4 + int(size)],
            2 * kept,
            f"{where} choices do not inflate",
            f"{where} choices are not one entry per kept component",
        )
        offsets = checked_offsets(np.frombuffer(raw, dtype=np.int8, count=kept), where)
        choices = np.frombuffer(raw, dtype=np.uint8, offset=kept)
        if int(choices.max(initial=0)) > len(self.tcq.family):
            raise CodecError(f"{where} choices name a table the family does not have")
        return 4 + int(size), offsets, choices

    def _layout(self, frame: Frame) -> _Layout:
        """Where the body's parts are, checked against the body."""
        h = self.header
        n = len(frame.token_ids)
        e = exact_count(self._frame_start(frame), n)
        exact = 2 * h.num_layers * h.num_kv_heads * e * h.head_dim * h.dtype.itemsize
        side, offsets, choices, refinement = 0, None, None, None
        if self.adaptive and n > e:
            side, offsets, choices = self._choices(frame, exact)
        if self.refined and n > e:
            where = f"frame {frame.index} is corrupt: tcq"
            size, refinement = read_refinement(frame.body, exact + side, h.num_layers, n - e, where)
            side += size
        count = 2 * h.num_layers
        body = frame.body
        if len(body) < exact + side + 4 * count:
            raise CodecError(
                f"frame {frame.index} is corrupt: tcq body is {len(body)} bytes, too short for "
                f"its exact tokens and stream directory"
            )
        words = np.frombuffer(body, dtype="<u4", count=count, offset=exact + side)
        words = words.astype(np.int64)
        if exact + side + 4 * count + 2 * int(words.sum()) != len(body):
            raise CodecError(
                f"frame {frame.index} is corrupt: tcq stream sizes do not add up to the body"
            )
        for s, w in enumerate(words):
            layer, k = self.layers[s // 2], s % 2
            empty = not len(self.code.kept[layer][k]) or n == e
            if (w == 0) != empty or (not empty and w < rans.STATE_WORDS):
                raise CodecError(f"frame {frame.index} is corrupt: tcq stream {s} has {w} words")
        return _Layout(e, exact, side, words, offsets, choices, refinement)

    def check(self, frame: Frame) -> None:
        body, _ = self._checked.get(frame.index, (None, None))
        if body is not frame.body:  # a frame is checked before decoding, and again in it
            self._checked[frame.index] = (frame.body, self._layout(frame))

    def _checked_layout(self, frame: Frame) -> _Layout:
        """The layout :meth:`check` found for this frame (so its choices inflate once), else
        the frame's layout checked now."""
        body, layout = self._checked.pop(frame.index, (None, None))
        return layout if body is frame.body else self._layout(frame)

    def decode(self, frames: list[Frame], out_dtype: torch.dtype) -> torch.Tensor:
        """Where each stream's product runs right after its symbols (:meth:`_fused`), a few
        frames' streams in one hand-out to the threads, so they wait once per hand-out, not
        once per frame; else frame by frame."""
        h = self.header
        if not self._fused(synthesis_arithmetic(out_dtype, self.streams.width, h.head_dim)):
            return super().decode(frames, out_dtype)
        out = self.checked_output(frames, out_dtype)
        starts = np.cumsum([0] + [len(frame.token_ids) for frame in frames])
        per = max(1, _HANDOUT_SCRATCH // self._scratch_bytes(h.chunk_tokens))
        for first in range(0, len(frames), per):
            group = range(first, min(first + per, len(frames)))
            jobs = [self._job(frames[i], out, int(starts[i]), i - first) for i in group]
            jobs = [job for job in jobs if job is not None]
            run_jobs([(kernel, work) for kernel, work, _ in jobs])
            for _, _, done in jobs:
                done()
        return out

    def _fused(self, arithmetic: str) -> bool:
        """Whether each stream's product, in ``arithmetic`` (:func:`synthesis_arithmetic`),
        runs right after its symbols, in one pass."""
        return arithmetic == INT16 and not self.predicted

    def _scratch_bytes(self, tokens: int) -> int:
        """The int16 coefficients' scratch of a fused frame of ``tokens`` tokens."""
        return 2 * len(self.streams.kept) * max(1, tokens) * self.streams.width

    def decode_frame(self, frame: Frame, out: torch.Tensor, token_offset: int) -> None:
        job = self._job(frame, out, token_offset, 0)
        if job is not None:
            kernel, work, done = job
            run_batches(kernel, work)
            done()

    def _job(self, frame: Frame, out: torch.Tensor, token_offset: int, slot: int):
        """``(kernel, work, done)`` of a frame (None once its exact tokens, all it has, are
        written): run ``kernel`` on batches of its streams (``work``: their relative costs),
        then ``done()``, which raises ``CodecError`` if a stream was corrupt and else finishes
        the frame's output. Its coefficients go to scratch ``slot``."""
        layout = self._checked_layout(frame)
        refined = None
        if layout.refinement is not None:  # checked before the streams write anything
            where = f"frame {frame.index} is corrupt: tcq"
            streams = self.streams
            refined = read_refined(layout.refinement, self.tcq, streams.kept, streams.width, where)
        return self._streams_job(frame, layout, out, token_offset, refined, slot)

    def _streams_job(
        self,
        frame: Frame,
        layout: _Layout,
        out: torch.Tensor,
        token_offset: int,
        refined: RefinedRows | None,
        slot: int,
    ):
        """:meth:`_job` of the frame's exact tokens and streams into ``out`` from token
        ``token_offset``, its ``refined`` rows refined."""
        h = self.header
        n = len(frame.token_ids)
        e = layout.exact_tokens
        L, H, D = h.num_layers, h.num_kv_heads, h.head_dim
        if e:
            raw = torch.frombuffer(bytearray(frame.body[: layout.exact_bytes]), dtype=torch.uint8)
            out[:, :, :, token_offset : token_offset + e] = raw.view(h.dtype).view(2, L, H, e, D)
        m = n - e
        if not m:
            return None
        streams = self.streams
        arithmetic = synthesis_arithmetic(out.dtype, streams.width, h.head_dim)
        coefficient_dtype, row_dtype = _DTYPES[arithmetic]
        # the prediction chain restores symbols in float32 before the synthesis
        scratch_dtype = torch.float32 if self.predicted else coefficient_dtype
        coefficients, rows = self._scratch_for(slot, m, scratch_dtype, row_dtype)
        symbols = self._symbols(frame, layout, _numpy_of(coefficients).reshape(-1), m)
        start = self._frame_start(frame) + e
        to, finish = _destination(h, self.thetas, start, m, out, token_offset + e)
        if self._fused(arithmetic):  # each stream's symbols, then its product
            product = self.synthesis.int16_product(
                coefficients.numpy(), layout.offsets, to, refined
            )
            work = symbols.work + streams.width * m  # the product's share, about as large
            if refined is not None:  # and the refined rows' corrections
                work = work + streams.width * np.diff(refined.start)

            def done() -> None:
                symbols.verify()
                finish()

            return (lambda todo: (symbols.kernel(todo), product(todo))), work, done

        def synthesize() -> None:
            symbols.verify()
            self.synthesis.synthesize(arithmetic, coefficients, rows, layout.offsets, to, refined)
            finish()

        return symbols.kernel, symbols.work, synthesize

    def _symbols(self, frame: Frame, layout: _Layout, out: np.ndarray, m: int) -> SymbolPass:
        """The pass that writes each stream's symbols less their radii into ``out``, flat
        [streams, m, width] (float32, int16, or bfloat16 bits if uint16): the frame's rANS
        streams decoded."""
        streams, code, words = self.streams, self.code, layout.words
        table_row = streams.table_row
        if layout.choices is not None:
            table_row = table_rows(code, streams.radius_int, layout.choices, table_row)
        data = np.frombuffer(
            frame.body, dtype="<u2", offset=layout.exact_bytes + layout.side_bytes + 4 * len(words)
        )
        word_off = np.concatenate([[0], np.cumsum(words)]).astype(np.int64)
        status = np.zeros(len(words), dtype=np.uint8)

        def decode_kernel(todo: np.ndarray) -> None:
            tcq_kernels.decode_coefficients(
                data,
                word_off,
                streams.kept,
                table_row,
                streams.radius_int,
                streams.radius_off,
                code.slot_sym,
                code.freq_cum,
                out,
                m,
                streams.width,
                todo,
                status,
            )

        def verify() -> None:
            if status.any():
                where = f"frame {frame.index} is corrupt"
                raise CodecError(f"{where}: a tcq rANS stream does not decode")

        return SymbolPass(decode_kernel, words + streams.kept * m + 1, verify)

    def inspect_extras(self) -> dict:
        tcq = self.tcq
        level = self.header.level
        return {
            "transform": tcq.id,
            "transform_bytes": tcq.nbytes,
            "table_bytes": tcq.table_bytes(level),
        }

    def layer_bytes(self, frame: Frame) -> np.ndarray:
        layout = self._layout(frame)
        h, words = self.header, layout.words
        per_stream = 2 * words.astype(np.float64).reshape(h.num_layers, 2)
        shared = layout.exact_bytes + layout.side_bytes + 4 * len(words)
        return per_stream + shared / (2 * h.num_layers)


@dataclass(frozen=True)
class _Synthesis:
    """The passes after a frame's symbols: its coefficients back into rows of K/V through the
    ``streams``' synthesis matrices, the ``predicted`` layers restored first, into a
    destination of ``heads`` heads."""

    streams: StreamTables
    predicted: list[tuple[int, LayerPredictor]]  # (layer position, its predictor)
    heads: int

    def synthesize(
        self,
        arithmetic: str,
        coefficients: torch.Tensor,
        rows: torch.Tensor,
        offsets: np.ndarray | None,
        to: int_synthesis.Destination,
        refined: RefinedRows | None,
    ) -> None:
        """The decoded symbols ``coefficients`` restored, refined and multiplied by the
        synthesis matrices in ``arithmetic``, written into ``to`` (the passes after the
        symbols where the product does not follow each stream's symbols)."""
        streams = self.streams
        coefficient_dtype = _DTYPES[arithmetic][0]
        if self.predicted:
            self._restore(coefficients, offsets)
        if refined is not None and arithmetic != INT16:  # floats hold the quarter steps
            refined.add_to(coefficients)
        coefficients = coefficients.to(coefficient_dtype)
        if arithmetic == INT16:  # the product and the write in one pass
            product = self.int16_product(coefficients.numpy(), offsets, to, refined)
            run_batches(product, np.ones(len(streams.kept)))
        else:  # one batched GEMM for all streams (torch's BLAS, in its own threads)
            matrices = streams.synthesis_bf16 if arithmetic == BF16 else streams.synthesis
            torch.bmm(coefficients, matrices, out=rows)
            mean = streams.mean if offsets is None else self._centred_mean(offsets)
            self._write(_numpy_of(rows), mean, to)

    def int16_product(
        self,
        coefficients: np.ndarray,
        offsets: np.ndarray | None,
        to: int_synthesis.Destination,
        refined: RefinedRows | None,
    ) -> Callable[[np.ndarray], None]:
        """The int16 kernel's product and write of streams ``todo``, the means moved by the
        frame's ``offsets`` (int8 per kept component) if it has them, its ``refined`` rows
        refined."""
        streams = self.streams
        shift = None
        if offsets is not None:
            moved = np.zeros((len(streams.kept), streams.width), dtype=np.int16)
            moved.reshape(-1)[streams.slot] = offsets
            shift = int_synthesis.Shift(moved, 1 / OFFSET_UNITS, np.empty_like(streams.mean))
        matrices = streams.integer_synthesis
        fine = None if refined is None else refined.integer()
        return int_synthesis.product(
            coefficients, matrices, streams.mean, to, shift, refinements=fine
        )

    def _restore(self, coefficients: torch.Tensor, offsets: np.ndarray) -> None:
        """The predicted layers' targets, decoded as residuals, back to their symbols (less
        the radii), layer after layer (:func:`cachegen.codec.tcq.predict.apply_predictions`)."""
        streams = self.streams
        first = np.append(streams.radius_off, streams.radius_off[-1] + streams.kept[-1])
        values = coefficients.numpy()
        apply_predictions(self.predicted, values, streams.radius_int, first, offsets, 1)

    def _centred_mean(self, offsets: np.ndarray) -> np.ndarray:
        """The channel means [streams, channels] moved by the frame's component offsets
        (their rows of the synthesis, which are already scaled by the steps)."""
        streams = self.streams
        moved = np.zeros((len(streams.kept), streams.width), dtype=np.float32)
        moved.reshape(-1)[streams.slot] = offsets
        shift = torch.bmm(torch.from_numpy(moved)[:, None], streams.synthesis)[:, 0]
        return streams.mean + shift.numpy() / OFFSET_UNITS

    def _write(self, rows: np.ndarray, mean: np.ndarray, to: int_synthesis.Destination) -> None:
        """Rows [streams, m, channels] (float32 or bfloat16 bits) plus the channel means
        ``mean``, keys turned, into ``to`` (:func:`tcq_kernels.write_rows`)."""
        bf16 = to.out.dtype == np.uint16
        out16 = to.out if bf16 else _NO_BF16
        out32 = _NO_F32 if bf16 else to.out
        H, D = self.heads, to.head_dim

        def write_kernel(todo: np.ndarray) -> None:
            tcq_kernels.write_rows(
                rows,
                mean,
                to.first_angle,
                to.cos,
                to.sin,
                H,
                D,
                out16,
                out32,
                to.base,
                to.out_tokens,
                todo,
            )

        run_batches(write_kernel, np.ones(len(to.base)))


def _destination(
    header: Header, layer_thetas: list, start: int, m: int, out: torch.Tensor, offset: int
) -> tuple[int_synthesis.Destination, Callable[[], None]]:
    """Where ``m`` tokens at absolute position ``start`` of a stream of ``header`` (its layers'
    rotary bases ``layer_thetas``) go: ``out`` from token ``offset`` in place when it is
    contiguous bf16 or float32, else a float32 scratch that the returned ``finish`` copies
    into ``out``."""
    h = header
    L, H, D = h.num_layers, h.num_kv_heads, h.head_dim
    direct = out.dtype in (torch.bfloat16, torch.float32) and out.is_contiguous()
    if direct:
        target, T, t0 = out, out.shape[3], offset
    else:
        target, T, t0 = torch.empty((2, L, H, m, D), dtype=torch.float32), m, 0
    thetas = tuple(sorted({t for t in layer_thetas if t}))
    cos, sin, positions = rotary_tables(D, thetas, start + m) if thetas else _NO_TABLES
    first_angle = np.array(
        [
            thetas.index(t) * positions + start if t and k == 0 else -1
            for t in layer_thetas
            for k in (0, 1)
        ],
        dtype=np.int64,
    )
    base = np.array(
        [((k * L + i) * H * T + t0) * D for i in range(L) for k in (0, 1)], dtype=np.int64
    )
    flat = _numpy_of(target.view(-1))
    to = int_synthesis.Destination(flat, base, T, D, cos, sin, first_angle)

    def finish() -> None:
        if not direct:
            out[:, :, :, offset : offset + m] = target

    return to, finish


def checked_offsets(offsets: np.ndarray, where: str) -> np.ndarray:
    """A frame's offsets (int8), refused (``CodecError``) where one is -128: encoders clip
    them to 127 in magnitude, the integer product's bound."""
    if np.any(offsets == -128):
        raise CodecError(f"{where} offsets hold -128, beyond 127 in magnitude")
    return offsets


def _numpy_of(x: torch.Tensor) -> np.ndarray:
    """``x``'s memory as numpy: float32, or bfloat16 bits as uint16."""
    return x.view(torch.int16).numpy().view(np.uint16) if x.dtype == torch.bfloat16 else x.numpy()


_NO_BF16 = np.zeros(0, dtype=np.uint16)
_NO_F32 = np.zeros(0, dtype=np.float32)
_NO_ANGLES = np.zeros((0, 0), dtype=np.float32)
_NO_TABLES = (_NO_ANGLES, _NO_ANGLES, 0)
