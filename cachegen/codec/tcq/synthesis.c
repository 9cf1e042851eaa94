/* The integer synthesis product of tcq's decoder (cachegen/codec/tcq/int_synthesis.py).

   row[k, t, c] = scale[k, c] * sum_j coefficients[k, t, j] * matrix[k, j, c] + mean[k, c]

   then keys turned by their rotary angles and written as bfloat16 bits or float32 into the
   output's [heads, tokens, head_dim] layout (the arithmetic of qkernels.store_row: the turn
   as two fused multiply-adds, bfloat16 rounded to nearest even), 
   for every stream k of `todo`: the coefficients are a frame's symbols less their radii
   (int16, |value| <= 127), the matrices the synthesis matrices rounded to int16 with one
   scale per stream and channel, stored as pairs of rows per octet of channels ([channels / 8]
   [width / 2][8][2], so that AVX2's vpmaddwd multiplies two coefficients of a token by two
   matrix rows of 8 channels and adds the products in one instruction, and the rows of one
   octet are contiguous: rows a power of two apart would fall into a few cache sets). The sums
   are exact in int32 (int_synthesis.py bounds the matrix entries so that no sum can
   overflow), so every CPU computes the same rows. On CPUs
   without AVX2 int16 multiply-adds are no faster than float32 ones: there
   cachegen_synthesis_supported() is 0 and the decoder keeps the float32 product.

   A tile of 4 tokens by 16 channels (8 channels of a head and the 8 its rotation pairs them
   with, head_dim / 2 further) keeps its 8 accumulators in registers while the matrix rows
   stream through (at 6 or 8 tokens AVX2's 16 registers spill; AVX-512's 32 hold a tile of 8
   tokens, which the VNNI loops use); 8 channels of a pair row are one
   aligned 32-byte load when the matrices are 64-byte aligned, as int_synthesis.py allocates
   them. Plain C loaded through ctypes: no Python object is
   touched, so the call runs without the GIL. */

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define CACHEGEN_AVX2 1
#endif

#define LANES 8

int cachegen_synthesis_supported(void) {
#ifdef CACHEGEN_AVX2
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
#else
    return 0;
#endif
}

/* Which loops run here: 2 AVX512-VNNI's, 1 AVX2's, 0 none (the float32 product is kept). */
int cachegen_synthesis_kernel(void) {
#ifdef CACHEGEN_AVX2
    if (!cachegen_synthesis_supported())
        return 0;
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") ? 2 : 1;
#else
    return 0;
#endif
}

/* Where a stream's rows go, and how: the arguments of cachegen_synthesize that do not change
   from stream to stream. */
typedef struct {
    int64_t tokens, width, channels, head_dim, out_tokens;
    const float *cos, *sin;  /* [angles, head_dim] */
    void *out;               /* bfloat16 bits (uint16) or float32 */
    int bf16;
    float offset_unit, refine_unit;
} Target;

#ifdef CACHEGEN_AVX2
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline __m256i load_pair(const int16_t *at) {
    int32_t pair;
    memcpy(&pair, at, sizeof pair);
    return _mm256_set1_epi32(pair);
}

/* float32 -> bfloat16 bits, rounded to nearest even (qkernels.f32_to_bf16), 8 lanes. */
AVX2 static inline void store_bf16(uint16_t *at, __m256 x) {
    __m256i bits = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i up = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd);
    __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(up, 16), _mm256_setzero_si256());
    packed = _mm256_permute4x64_epi64(packed, 0x08);  /* qwords 0 and 2: lanes 0-3, 4-7 */
    _mm_storeu_si128((__m128i *)at, _mm256_castsi256_si128(packed));
}

AVX2 static inline void store8(const Target *target, int64_t at, __m256 x) {
    if (target->bf16)
        store_bf16((uint16_t *)target->out + at, x);
    else
        _mm256_storeu_ps((float *)target->out + at, x);
}

/* 8 bfloat16 bits at `at` as float32. */
AVX2 static inline __m256 load_bf16(const uint16_t *at) {
    __m128i bits = _mm_loadu_si128((const __m128i *)at);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

AVX2 static inline __m256 load8(const Target *target, int64_t at) {
    if (target->bf16)
        return load_bf16((const uint16_t *)target->out + at);
    return _mm256_loadu_ps((const float *)target->out + at);
}

/* 8 channels from d (x1) and their partners from d + head_dim / 2 (x2) turned by angle row
   `angle` when it is not negative (the turn as two fused multiply-adds). */
AVX2 static inline void turn(const Target *target, __m256 *x1, __m256 *x2, int64_t half,
                             int64_t angle, int64_t d) {
    if (angle < 0)
        return;
    const float *c = target->cos + angle * target->head_dim + d;
    const float *s = target->sin + angle * target->head_dim + d;
    __m256 y1 = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_setzero_ps(), *x2), _mm256_loadu_ps(s),
                                _mm256_mul_ps(*x1, _mm256_loadu_ps(c)));
    __m256 y2 = _mm256_fmadd_ps(*x1, _mm256_loadu_ps(s + half),
                                _mm256_mul_ps(*x2, _mm256_loadu_ps(c + half)));
    *x1 = y1, *x2 = y2;
}

/* One token's 8 channels from d and their 8 partners from d + head_dim / 2: scaled, the means
   added, turned by angle row `angle` when it is not negative, stored at `at`. */
AVX2 static inline void put(const Target *target, __m256i low, __m256i high, const float *scale,
                            const float *mean, int64_t half, int64_t angle, int64_t d,
                            int64_t at) {
    __m256 x1 = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(low), _mm256_loadu_ps(scale)),
                              _mm256_loadu_ps(mean));
    __m256 x2 = _mm256_add_ps(
        _mm256_mul_ps(_mm256_cvtepi32_ps(high), _mm256_loadu_ps(scale + half)),
        _mm256_loadu_ps(mean + half));
    turn(target, &x1, &x2, half, angle, d);
    store8(target, at, x1);
    store8(target, at + half, x2);
}

/* A refined row's correction of the same channels: scaled, times the refinements' unit (a
   power of two: exact), turned as put turns them, added to the row already stored at `at`. */
AVX2 static inline void add_put(const Target *target, __m256i low, __m256i high,
                                const float *scale, int64_t half, int64_t angle, int64_t d,
                                int64_t at) {
    __m256 unit = _mm256_set1_ps(target->refine_unit);
    __m256 x1 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(low), _mm256_loadu_ps(scale)),
                              unit);
    __m256 x2 = _mm256_mul_ps(
        _mm256_mul_ps(_mm256_cvtepi32_ps(high), _mm256_loadu_ps(scale + half)), unit);
    turn(target, &x1, &x2, half, angle, d);
    store8(target, at, _mm256_add_ps(load8(target, at), x1));
    store8(target, at + half, _mm256_add_ps(load8(target, at + half), x2));
}

/* The loops, once with AVX2's vpmaddwd + vpaddd and once with AVX512-VNNI's vpdpwssd, which
   does both in one instruction on the same 256-bit registers (the same exact sums). */
#define KERNEL AVX2
#define DOT(acc, a, b) _mm256_add_epi32(_mm256_madd_epi16(a, b), acc)
#define TILE 4
#define SUFFIX _avx2
#include "synthesis_loops.h"
#undef KERNEL
#undef DOT
#undef TILE
#undef SUFFIX

#define KERNEL __attribute__((target("avx2,fma,avx512f,avx512vl,avx512vnni")))
#define DOT(acc, a, b) _mm256_dpwssd_epi32(acc, a, b)
#define TILE 8
#define SUFFIX _vnni
#include "synthesis_loops.h"
#undef KERNEL
#undef DOT
#undef TILE
#undef SUFFIX

#endif

/* Streams todo[0 .. count) of [streams, tokens, width] int16 coefficients, synthesized with
   their pairs [streams, channels / 8, width / 2, 8, 2] and scales [streams, channels], plus their
   means [streams, channels] (moved by their frame's offsets [streams, width] in units of
   offset_unit when offsets is not NULL: the moved means go to shifted [streams, channels]),
   into `out`: head h of token t of stream k at base[k] + (h *
   out_tokens + t) * head_dim, keys turned by angle row first_angle[k] + t of cos / sin
   (first_angle[k] < 0: not turned), as bfloat16 bits when bf16 is nonzero, else float32;
   then, when refined is not NULL, the stream's refined rows: rows refined_start[k] ..
   refined_start[k + 1] of refined [rows, width] (int16 refinements) times the stream's matrix
   and refine_unit, turned as its rows are, added to the rows of its coded tokens
   refined_token[..] (tcq_refine.py); by the loops numbered `loops`
   (cachegen_synthesis_kernel's numbers; AVX2's where the CPU lacks the ones asked for).
   width even, head_dim a multiple of 16, channels a multiple of head_dim (int_synthesis.fits). */
void cachegen_synthesize(const int16_t *coefficients, const int16_t *pairs, const float *scale,
                         const float *mean, const int16_t *offsets, float offset_unit,
                         float *shifted, int64_t tokens, int64_t width, int64_t channels,
                         int64_t head_dim, const float *cos, const float *sin,
                         const int64_t *first_angle, void *out, int bf16, const int64_t *base,
                         int64_t out_tokens, const int16_t *refined, const int64_t *refined_start,
                         const int64_t *refined_token, float refine_unit, int loops,
                         const int64_t *todo, int64_t count) {
    Target target = {tokens, width, channels, head_dim, out_tokens, cos, sin, out, bf16,
                     offset_unit, refine_unit};
#ifdef CACHEGEN_AVX2
    const int fused = loops == 2 && cachegen_synthesis_kernel() == 2;
    for (int64_t i = 0; i < count; i++) {
        int64_t k = todo[i];
        const int16_t *matrix = pairs + k * width * channels;
        const float *moved = mean + k * channels;
        if (offsets) {
            (fused ? shift_means_vnni : shift_means_avx2)(&target, offsets + k * width, matrix,
                                                          scale + k * channels, moved,
                                                          shifted + k * channels);
            moved = shifted + k * channels;
        }
        (fused ? stream_vnni : stream_avx2)(&target, coefficients + k * tokens * width, matrix,
                                            scale + k * channels, moved, first_angle[k],
                                            base[k]);
        if (refined && refined_start[k + 1] > refined_start[k])
            (fused ? correct_vnni : correct_avx2)(
                &target, refined + refined_start[k] * width, refined_start[k + 1] - refined_start[k],
                refined_token + refined_start[k], matrix, scale + k * channels, first_angle[k],
                base[k]);
    }
#else
    (void)target, (void)coefficients, (void)pairs, (void)scale, (void)mean, (void)first_angle;
    (void)offsets, (void)shifted, (void)refined, (void)refined_start, (void)refined_token;
    (void)refine_unit, (void)base, (void)loops, (void)todo, (void)count;
#endif
}
