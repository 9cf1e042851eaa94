/* The integer synthesis product of tcq's decoder (cachegen/codec/int_synthesis.py).

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
   stream through (at 6 or 8 tokens the accumulators spill); 8 channels of a pair row are one
   aligned 32-byte load when the matrices are 64-byte aligned, as int_synthesis.py allocates
   them. Plain C loaded through ctypes: no Python object is
   touched, so the call runs without the GIL. */

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define CACHEGEN_AVX2 1
#endif

#define TILE_TOKENS 4
#define LANES 8

int cachegen_synthesis_supported(void) {
#ifdef CACHEGEN_AVX2
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
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
    float offset_unit;
} Target;

#ifdef CACHEGEN_AVX2
#define AVX2 __attribute__((target("avx2,fma")))
#define MADD(acc, a, b) acc = _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))

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
    if (angle >= 0) {
        const float *c = target->cos + angle * target->head_dim + d;
        const float *s = target->sin + angle * target->head_dim + d;
        __m256 y1 = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_setzero_ps(), x2), _mm256_loadu_ps(s),
                                    _mm256_mul_ps(x1, _mm256_loadu_ps(c)));
        __m256 y2 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(s + half),
                                    _mm256_mul_ps(x2, _mm256_loadu_ps(c + half)));
        x1 = y1, x2 = y2;
    }
    store8(target, at, x1);
    store8(target, at + half, x2);
}

/* The int32 sums of 4 tokens (coefficients x, rows `width` apart) by the pair rows b (pair rows
   `step` apart): channels at b into sums[0..3], those `high` further into sums[4..7]. Named
   accumulators, not an array: with an array GCC copies every accumulator once per row. */
AVX2 static inline void sum_four(const int16_t *x, int64_t width, const int16_t *b, int64_t step,
                                 int64_t high, __m256i sums[8]) {
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0,
            s7 = s0;
    for (int64_t j = 0; j < width; j += 2, b += step) {
        __m256i low = _mm256_loadu_si256((const __m256i *)b);
        __m256i up = _mm256_loadu_si256((const __m256i *)(b + high));
        __m256i a0 = load_pair(x + j), a1 = load_pair(x + width + j);
        __m256i a2 = load_pair(x + 2 * width + j), a3 = load_pair(x + 3 * width + j);
        s0 = _mm256_add_epi32(_mm256_madd_epi16(a0, low), s0);
        s4 = _mm256_add_epi32(_mm256_madd_epi16(a0, up), s4);
        s1 = _mm256_add_epi32(_mm256_madd_epi16(a1, low), s1);
        s5 = _mm256_add_epi32(_mm256_madd_epi16(a1, up), s5);
        s2 = _mm256_add_epi32(_mm256_madd_epi16(a2, low), s2);
        s6 = _mm256_add_epi32(_mm256_madd_epi16(a2, up), s6);
        s3 = _mm256_add_epi32(_mm256_madd_epi16(a3, low), s3);
        s7 = _mm256_add_epi32(_mm256_madd_epi16(a3, up), s7);
    }
    sums[0] = s0, sums[1] = s1, sums[2] = s2, sums[3] = s3;
    sums[4] = s4, sums[5] = s5, sums[6] = s6, sums[7] = s7;
}

/* The sums of one token, as sum_four's. */
AVX2 static inline void sum_one(const int16_t *x, int64_t width, const int16_t *b, int64_t step,
                                int64_t high, __m256i sums[8]) {
    __m256i s0 = _mm256_setzero_si256(), s4 = s0;
    for (int64_t j = 0; j < width; j += 2, b += step) {
        __m256i a = load_pair(x + j);
        s0 = _mm256_add_epi32(_mm256_madd_epi16(a, _mm256_loadu_si256((const __m256i *)b)), s0);
        s4 = _mm256_add_epi32(
            _mm256_madd_epi16(a, _mm256_loadu_si256((const __m256i *)(b + high))), s4);
    }
    sums[0] = s0, sums[4] = s4;
}

/* Tokens t .. t + n - 1 (n is 4 or 1) of channels c .. c + 7 and c + half .. c + half + 7 of
   head h, d = c - h * head_dim. */
AVX2 static inline void tile(const Target *target, const int16_t *coefficients,
                             const int16_t *pairs, const float *scale, const float *mean,
                             int64_t first_angle, int64_t base, int64_t t, const int n,
                             int64_t h, int64_t d) {
    const int64_t width = target->width;
    const int64_t half = target->head_dim / 2, c = h * target->head_dim + d;
    const int16_t *x = coefficients + t * width, *b = pairs + c * width;  /* octet c / 8 */
    __m256i sums[8];
    if (n == TILE_TOKENS)
        sum_four(x, width, b, 2 * LANES, half * width, sums);
    else
        sum_one(x, width, b, 2 * LANES, half * width, sums);
    for (int i = 0; i < n; i++) {
        int64_t angle = first_angle < 0 ? -1 : first_angle + t + i;
        int64_t at = base + (h * target->out_tokens + t + i) * target->head_dim + d;
        put(target, sums[i], sums[4 + i], scale + c, mean + c, half, angle, d, at);
    }
}

AVX2 static void four(const Target *target, const int16_t *coefficients, const int16_t *pairs,
                      const float *scale, const float *mean, int64_t first_angle, int64_t base,
                      int64_t t, int64_t h, int64_t d) {
    tile(target, coefficients, pairs, scale, mean, first_angle, base, t, TILE_TOKENS, h, d);
}

AVX2 static void one(const Target *target, const int16_t *coefficients, const int16_t *pairs,
                     const float *scale, const float *mean, int64_t first_angle, int64_t base,
                     int64_t t, int64_t h, int64_t d) {
    tile(target, coefficients, pairs, scale, mean, first_angle, base, t, 1, h, d);
}

/* The channel means moved by a frame's component offsets: shifted[c] = mean[c] + unit *
   scale[c] * sum_j offsets[j] * matrix[j, c] (offsets bounded like coefficients, so the sums
   are exact too). */
AVX2 static void shift_means(const Target *target, const int16_t *offsets, const int16_t *pairs,
                             const float *scale, const float *mean, float *shifted) {
    const int64_t width = target->width, channels = target->channels;
    const __m256 unit = _mm256_set1_ps(target->offset_unit);
    for (int64_t c = 0; c < channels; c += LANES) {
        __m256i acc = _mm256_setzero_si256();
        const int16_t *b = pairs + c * width;
        for (int64_t j = 0; j < width; j += 2, b += 2 * LANES)
            MADD(acc, load_pair(offsets + j), _mm256_loadu_si256((const __m256i *)b));
        __m256 sum = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_loadu_ps(scale + c));
        __m256 moved = _mm256_mul_ps(sum, unit);
        _mm256_storeu_ps(shifted + c, _mm256_add_ps(_mm256_loadu_ps(mean + c), moved));
    }
}

AVX2 static void stream(const Target *target, const int16_t *coefficients, const int16_t *pairs,
                        const float *scale, const float *mean, int64_t first_angle,
                        int64_t base) {
    const int64_t heads = target->channels / target->head_dim, half = target->head_dim / 2;
    const int64_t whole = target->tokens - target->tokens % TILE_TOKENS;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t d = 0; d < half; d += LANES) {  /* these channels' rows stay in L1 */
            int64_t t = 0;
            for (; t < whole; t += TILE_TOKENS)
                four(target, coefficients, pairs, scale, mean, first_angle, base, t, h, d);
            for (; t < target->tokens; t++)
                one(target, coefficients, pairs, scale, mean, first_angle, base, t, h, d);
        }
}
#endif

/* Streams todo[0 .. count) of [streams, tokens, width] int16 coefficients, synthesized with
   their pairs [streams, channels / 8, width / 2, 8, 2] and scales [streams, channels], plus their
   means [streams, channels] (moved by their frame's offsets [streams, width] in units of
   offset_unit when offsets is not NULL: the moved means go to shifted [streams, channels]),
   into `out`: head h of token t of stream k at base[k] + (h *
   out_tokens + t) * head_dim, keys turned by angle row first_angle[k] + t of cos / sin
   (first_angle[k] < 0: not turned), as bfloat16 bits when bf16 is nonzero, else float32.
   width even, head_dim a multiple of 16, channels a multiple of head_dim (int_synthesis.fits). */
void cachegen_synthesize(const int16_t *coefficients, const int16_t *pairs, const float *scale,
                         const float *mean, const int16_t *offsets, float offset_unit,
                         float *shifted, int64_t tokens, int64_t width, int64_t channels,
                         int64_t head_dim, const float *cos, const float *sin,
                         const int64_t *first_angle, void *out, int bf16, const int64_t *base,
                         int64_t out_tokens, const int64_t *todo, int64_t count) {
    Target target = {tokens, width, channels, head_dim, out_tokens, cos, sin, out, bf16,
                     offset_unit};
#ifdef CACHEGEN_AVX2
    for (int64_t i = 0; i < count; i++) {
        int64_t k = todo[i];
        const int16_t *matrix = pairs + k * width * channels;
        const float *moved = mean + k * channels;
        if (offsets) {
            shift_means(&target, offsets + k * width, matrix, scale + k * channels, moved,
                        shifted + k * channels);
            moved = shifted + k * channels;
        }
        stream(&target, coefficients + k * tokens * width, matrix, scale + k * channels, moved,
               first_angle[k], base[k]);
    }
#else
    (void)target, (void)coefficients, (void)pairs, (void)scale, (void)mean, (void)first_angle;
    (void)offsets, (void)shifted;
    (void)base, (void)todo, (void)count;
#endif
}
