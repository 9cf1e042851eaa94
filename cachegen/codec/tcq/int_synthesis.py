"""tcq's synthesis product in integers, fused with the pass that writes the output, on CPUs
with AVX2 (``synthesis.c``, loaded through ctypes).

A frame's coefficients are small integers (symbols less their radii, at most 127 in
magnitude), so the product ``coefficients @ synthesis`` can run in int16 x int16 -> int32
multiply-adds: AVX2's ``vpmaddwd`` does 16 of them per instruction where a float32 FMA does 8,
and on CPUs without AMX that makes the product faster than torch's float32 one, and than its
bfloat16 one on AVX512-BF16 (``benchmarks/micro/test_synthesis_gemm.py``; docs/codec.md,
"Decode speed"). On CPUs with AVX512-VNNI the same loops run with ``vpdpwssd``, which also
adds the products to the sums: one instruction where AVX2 needs two.
The synthesis matrices are rounded to int16 with one scale per stream and channel,
as large as the int32 sums allow: an error far below the bfloat16 output's rounding. The
sums are exact, so every CPU decodes the same rows. The kernel then adds the channel means,
turns keys and writes bfloat16 bits or float32 into the output's head layout as
``tcq_kernels.write_rows`` does, so the rows never go through memory as float32.

The kernel is compiled when the package is installed (``setup.py``); without a C compiler it
is absent, and :func:`available` is False: the decoder keeps the float32 product.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

MAX_COEFFICIENT = 127  # a tcq radius's bound (cachegen.fitting.tcq), hence a symbol's
_INT32_MAX = 2**31 - 1
LANES = 8  # float32 lanes of an AVX2 register: the kernel's channels per load (synthesis.c)
CACHE_LINE = 64

_POINTER = ctypes.c_void_p
_INT = ctypes.c_int64


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, when it was built and the CPU runs it; else None."""
    spec = importlib.util.find_spec("cachegen.codec.tcq._synthesis")
    if spec is None or spec.origin is None:
        return None
    library = ctypes.CDLL(spec.origin)
    if not library.cachegen_synthesis_supported():
        return None
    library.cachegen_synthesis_kernel.restype = ctypes.c_int
    library.cachegen_synthesize.restype = None
    library.cachegen_synthesize.argtypes = (
        [_POINTER] * 5
        + [ctypes.c_float, _POINTER]
        + [_INT] * 4
        + [_POINTER] * 4
        + [ctypes.c_int, _POINTER, _INT]
        + [_POINTER] * 3
        + [ctypes.c_float, ctypes.c_int, _POINTER, _INT]
    )
    return library


def available() -> bool:
    """Whether the integer product runs here (the kernel was built and the CPU has AVX2
    and FMA)."""
    return _library() is not None


AVX2_LOOPS, VNNI_LOOPS = "avx2", "avx512-vnni"
_LOOPS = {AVX2_LOOPS: 1, VNNI_LOOPS: 2}  # synthesis.c's numbers


def loops_here() -> tuple[str, ...]:
    """The kernel's loops this CPU runs, fastest last: ``avx2`` (``vpmaddwd`` then
    ``vpaddd``) and, on CPUs with AVX512-VNNI, ``avx512-vnni`` (one ``vpdpwssd`` for both, on
    the same 256-bit registers); none where the kernel does not run. All compute the same
    exact sums."""
    library = _library()
    best = 0 if library is None else library.cachegen_synthesis_kernel()
    return tuple(name for name, number in _LOOPS.items() if number <= best)


@dataclass(frozen=True)
class IntegerSynthesis:
    """Synthesis matrices [streams, width, channels] in the kernel's form: int16 rows in
    pairs per octet of channels ``[streams, channels / 8, width / 2, 8, 2]`` and one float32
    scale per stream and channel ``[streams, channels]``."""

    pairs: np.ndarray
    scale: np.ndarray

    @classmethod
    def of(cls, synthesis: torch.Tensor) -> IntegerSynthesis:
        """``synthesis`` (float32, an even ``width``) rounded to int16 with one scale per stream
        and channel, each stream's entries as large as int32 sums over its nonzero rows allow
        (coefficients of magnitude up to ``MAX_COEFFICIENT``): a stream rounds alike in every
        set of layers it is decoded with."""
        streams, width, channels = synthesis.shape
        matrices = synthesis.numpy().astype(np.float64)
        rows = np.maximum(1, np.count_nonzero(np.abs(matrices).max(axis=2), axis=1))
        top = np.minimum(32767, _INT32_MAX // (MAX_COEFFICIENT * rows))  # [streams]
        largest = np.abs(matrices).max(axis=1)  # [streams, channels]
        scale = np.where(largest > 0, largest / top[:, None], 1.0).astype(np.float32)
        entries = np.rint(matrices / scale[:, None, :]).astype(np.int16)
        octets = entries.reshape(streams, width // 2, 2, channels // LANES, LANES)
        return cls(_aligned(octets.transpose(0, 3, 1, 4, 2)), scale)

    def entries(self) -> np.ndarray:
        """The int16 matrices [streams, width, channels]."""
        streams, octets, pairs, _, _ = self.pairs.shape
        rows = self.pairs.transpose(0, 2, 4, 1, 3)
        return rows.reshape(streams, 2 * pairs, octets * LANES)


def _aligned(array: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of ``array`` starting on a 64-byte boundary (the kernel's loads of
    one pair row of 16 channels then stay within one cache line)."""
    room = np.empty(array.nbytes + CACHE_LINE, dtype=np.uint8)
    start = -room.ctypes.data % CACHE_LINE
    out = room[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


def fits(width: int, head_dim: int) -> bool:
    """Whether the kernel takes matrices of this shape: an even width (pairs of rows), and
    head dims whose halves are whole vectors of 8 channels."""
    return width % 2 == 0 and head_dim % (2 * LANES) == 0


@dataclass(frozen=True)
class Destination:
    """Where a frame's rows go: head ``h`` of token ``t`` of stream ``k`` at ``base[k] + (h *
    out_tokens + t) * head_dim`` of ``out`` (flat: bfloat16 bits as uint16, or float32), keys
    turned by angle row ``first_angle[k] + t`` of ``cos`` / ``sin`` ([angles, head_dim],
    float32; ``first_angle[k]`` -1: not turned)."""

    out: np.ndarray
    base: np.ndarray
    out_tokens: int
    head_dim: int
    cos: np.ndarray
    sin: np.ndarray
    first_angle: np.ndarray


@dataclass(frozen=True)
class Shift:
    """A frame's offsets of the coefficients, ``offsets`` [streams, width] (int16, at most
    ``MAX_COEFFICIENT`` in magnitude) in units of ``unit``: they move the channel means by
    ``unit * offsets @ matrix``, which the kernel computes per stream into ``means`` [streams,
    channels] (float32, overwritten) before the stream's rows."""

    offsets: np.ndarray
    unit: float
    means: np.ndarray


@dataclass(frozen=True)
class Refinements:
    """Rows a frame refines after the product writes them: stream ``k``'s are rows
    ``start[k] .. start[k + 1]`` of ``rows`` [n, width] (int16, at most ``MAX_COEFFICIENT``
    in magnitude), of its coded tokens ``tokens[start[k] .. start[k + 1]]``; each row times
    the stream's matrix and ``unit`` is added, turned as the stream's rows are, to the row
    written for its token."""

    rows: np.ndarray
    start: np.ndarray  # [streams + 1] int64
    tokens: np.ndarray  # [n] int64
    unit: float


def product(
    coefficients: np.ndarray,
    matrices: IntegerSynthesis,
    mean: np.ndarray,
    to: Destination,
    shift: Shift | None = None,
    loops: str | None = None,
    refinements: Refinements | None = None,
) -> Callable[[np.ndarray], None]:
    """The product of ``coefficients`` [streams, tokens, width] (int16) with their matrices,
    plus their channel means ``mean`` [streams, channels] (float32) moved by ``shift`` if
    given, into ``to``, then each stream's ``refinements`` if given: a function that runs it
    for streams ``todo`` (in any thread; the arrays are checked once, here), by ``loops``
    (default: this CPU's fastest, :func:`loops_here`). The caller checks :func:`available`
    and :func:`fits` first; the arrays are C-contiguous."""
    library = _library()
    if library is None:
        raise ValueError("integer synthesis: the kernel is not built here, or the CPU lacks AVX2")
    here = loops_here()
    if loops is not None and loops not in here:
        raise ValueError(f"integer synthesis: no {loops} loops on this CPU (it runs {here})")
    _check(coefficients, matrices, mean, to, shift)
    if refinements is not None:
        _check_refinements(refinements, coefficients.shape)
    streams, tokens, width = coefficients.shape
    arguments = (
        coefficients.ctypes.data,
        matrices.pairs.ctypes.data,
        matrices.scale.ctypes.data,
        mean.ctypes.data,
        None if shift is None else shift.offsets.ctypes.data,
        0.0 if shift is None else shift.unit,
        None if shift is None else shift.means.ctypes.data,
        tokens,
        width,
        mean.shape[1],
        to.head_dim,
        to.cos.ctypes.data,
        to.sin.ctypes.data,
        to.first_angle.ctypes.data,
        to.out.ctypes.data,
        int(to.out.dtype == np.uint16),
        to.base.ctypes.data,
        to.out_tokens,
        None if refinements is None else refinements.rows.ctypes.data,
        None if refinements is None else refinements.start.ctypes.data,
        None if refinements is None else refinements.tokens.ctypes.data,
        0.0 if refinements is None else refinements.unit,
        _LOOPS[loops or here[-1]],
    )
    arrays = (coefficients, matrices, mean, to, shift, refinements)
    return _Product(library, arguments, streams, arrays)


@dataclass(frozen=True)
class _Product:
    """:func:`product`'s kernel call, its arrays' addresses in ``arguments``; ``arrays`` keeps
    them alive as long as the call is."""

    library: ctypes.CDLL
    arguments: tuple
    streams: int
    arrays: tuple

    def __call__(self, todo: np.ndarray) -> None:
        todo = np.ascontiguousarray(todo, dtype=np.int64)
        if len(todo) and not (0 <= todo.min() and todo.max() < self.streams):
            raise ValueError("integer synthesis: a stream index out of range")
        self.library.cachegen_synthesize(*self.arguments, todo.ctypes.data, len(todo))


def _check(
    coefficients: np.ndarray,
    matrices: IntegerSynthesis,
    mean: np.ndarray,
    to: Destination,
    shift: Shift | None,
) -> None:
    """The kernel reads raw memory: every array's dtype, layout and shape, checked first."""
    streams, _, width = coefficients.shape
    channels = mean.shape[1]
    wanted = [
        (coefficients, np.int16, (streams, coefficients.shape[1], width)),
        (matrices.pairs, np.int16, (streams, channels // LANES, width // 2, LANES, 2)),
        (matrices.scale, np.float32, (streams, channels)),
        (mean, np.float32, (streams, channels)),
        (to.base, np.int64, (streams,)),
        (to.first_angle, np.int64, (streams,)),
    ]
    if shift is not None:
        wanted += [
            (shift.offsets, np.int16, (streams, width)),
            (shift.means, np.float32, (streams, channels)),
        ]
        if np.abs(shift.offsets.astype(np.int32)).max(initial=0) > MAX_COEFFICIENT:
            raise ValueError(f"integer synthesis: offsets beyond {MAX_COEFFICIENT}")
    turned = to.first_angle >= 0
    angles = (to.cos.shape[0], to.head_dim) if turned.any() else to.cos.shape
    if (to.first_angle[turned] + coefficients.shape[1]).max(initial=0) > to.cos.shape[0]:
        raise ValueError("integer synthesis: a stream's angles run past the cos/sin rows")
    wanted += [(to.cos, np.float32, angles), (to.sin, np.float32, angles)]
    for array, dtype, shape in wanted:
        if array.dtype != dtype or array.shape != shape or not array.flags.c_contiguous:
            raise ValueError(f"integer synthesis: an array of {array.dtype} {array.shape}")
    if to.out.dtype not in (np.uint16, np.float32) or not fits(width, to.head_dim):
        raise ValueError("integer synthesis: bfloat16 bits or float32 out, and a shape it fits")
    if channels % to.head_dim:
        raise ValueError("integer synthesis: channels are not whole heads")


def _check_refinements(fine: Refinements, shape: tuple[int, int, int]) -> None:
    """The refinements' arrays, and that every row they add to is one the product writes."""
    streams, tokens, width = shape
    n = fine.rows.shape[0]
    wanted = [(fine.rows, np.int16, (n, width)), (fine.start, np.int64, (streams + 1,))]
    wanted += [(fine.tokens, np.int64, (n,))]
    for array, dtype, want in wanted:
        if array.dtype != dtype or array.shape != want or not array.flags.c_contiguous:
            raise ValueError(f"integer synthesis: refinements of {array.dtype} {array.shape}")
    if fine.start[0] != 0 or fine.start[-1] != n or np.any(np.diff(fine.start) < 0):
        raise ValueError("integer synthesis: refinements' stream starts out of order")
    if n and not (0 <= fine.tokens.min() and fine.tokens.max() < tokens):
        raise ValueError("integer synthesis: a refined token out of range")
    if np.abs(fine.rows.astype(np.int32)).max(initial=0) > MAX_COEFFICIENT:
        raise ValueError(f"integer synthesis: refinements beyond {MAX_COEFFICIENT}")
