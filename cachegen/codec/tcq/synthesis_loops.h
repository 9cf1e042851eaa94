/* The integer synthesis kernel's loops, compiled once per instruction set by synthesis.c:
   it defines KERNEL (the target attribute), DOT(acc, a, b) (acc plus the int32 sums of the
   int16 pair products of a and b, exact), TILE (the tokens of a tile: 4 or 8) and SUFFIX
   (appended to every name), then includes this file. The helpers they call (load_pair, put,
   add_put) are synthesis.c's AVX2 ones. */

#define PASTE2(a, b) a##b
#define PASTE(a, b) PASTE2(a, b)
#define NAME(f) PASTE(f, SUFFIX)

/* The int32 sums of TILE tokens (coefficients x, rows `width` apart) by the pair rows b (pair
   rows `step` apart): channels at b into sums[0 .. TILE), those `high` further into
   sums[TILE .. 2 TILE). Named accumulators (low##k and up##k for token k), not an array: with
   an array GCC copies every accumulator once per row. 8 tokens need 16 accumulators besides
   the two rows and the broadcasts: only the 32 registers of AVX-512 hold them (at 6 or 8
   tokens AVX2's 16 spill). */
#if TILE == 8
#define EACH_TOKEN(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7)
#else
#define EACH_TOKEN(M) M(0) M(1) M(2) M(3)
#endif
#define DECLARE(k) __m256i low##k = _mm256_setzero_si256(), up##k = low##k;
#define ACCUMULATE(k)                                                                        \
    {                                                                                        \
        __m256i a = load_pair(x + k * width + j);                                            \
        low##k = DOT(low##k, a, low), up##k = DOT(up##k, a, up);                             \
    }
#define KEEP(k) sums[k] = low##k, sums[TILE + k] = up##k;

KERNEL static inline void NAME(sum_tile)(const int16_t *x, int64_t width, const int16_t *b,
                                         int64_t step, int64_t high, __m256i sums[2 * TILE]) {
    EACH_TOKEN(DECLARE)
    for (int64_t j = 0; j < width; j += 2, b += step) {
        __m256i low = _mm256_loadu_si256((const __m256i *)b);
        __m256i up = _mm256_loadu_si256((const __m256i *)(b + high));
        EACH_TOKEN(ACCUMULATE)
    }
    EACH_TOKEN(KEEP)
}

#undef EACH_TOKEN
#undef DECLARE
#undef ACCUMULATE
#undef KEEP

/* The sums of one token, as sum_tile's. */
KERNEL static inline void NAME(sum_one)(const int16_t *x, int64_t width, const int16_t *b, int64_t step,
                                int64_t high, __m256i sums[8]) {
    __m256i s0 = _mm256_setzero_si256(), s4 = s0;
    for (int64_t j = 0; j < width; j += 2, b += step) {
        __m256i a = load_pair(x + j);
        s0 = DOT(s0, a, _mm256_loadu_si256((const __m256i *)b));
        s4 = DOT(s4, a, _mm256_loadu_si256((const __m256i *)(b + high)));
    }
    sums[0] = s0, sums[TILE] = s4;
}

/* Tokens t .. t + n - 1 (n is TILE or 1) of channels c .. c + 7 and c + half .. c + half + 7 of
   head h, d = c - h * head_dim. */
KERNEL static inline void NAME(tile)(const Target *target, const int16_t *coefficients,
                             const int16_t *pairs, const float *scale, const float *mean,
                             int64_t first_angle, int64_t base, int64_t t, const int n,
                             int64_t h, int64_t d) {
    const int64_t width = target->width;
    const int64_t half = target->head_dim / 2, c = h * target->head_dim + d;
    const int16_t *x = coefficients + t * width, *b = pairs + c * width;  /* octet c / 8 */
    __m256i sums[2 * TILE];
    if (n == TILE)
        NAME(sum_tile)(x, width, b, 2 * LANES, half * width, sums);
    else
        NAME(sum_one)(x, width, b, 2 * LANES, half * width, sums);
    for (int i = 0; i < n; i++) {
        int64_t angle = first_angle < 0 ? -1 : first_angle + t + i;
        int64_t at = base + (h * target->out_tokens + t + i) * target->head_dim + d;
        put(target, sums[i], sums[TILE + i], scale + c, mean + c, half, angle, d, at);
    }
}

KERNEL static void NAME(whole_tile)(const Target *target, const int16_t *coefficients, const int16_t *pairs,
                      const float *scale, const float *mean, int64_t first_angle, int64_t base,
                      int64_t t, int64_t h, int64_t d) {
    NAME(tile)(target, coefficients, pairs, scale, mean, first_angle, base, t, TILE, h, d);
}

KERNEL static void NAME(one)(const Target *target, const int16_t *coefficients, const int16_t *pairs,
                     const float *scale, const float *mean, int64_t first_angle, int64_t base,
                     int64_t t, int64_t h, int64_t d) {
    NAME(tile)(target, coefficients, pairs, scale, mean, first_angle, base, t, 1, h, d);
}

/* The channel means moved by a frame's component offsets: shifted[c] = mean[c] + unit *
   scale[c] * sum_j offsets[j] * matrix[j, c] (offsets bounded like coefficients, so the sums
   are exact too). */
KERNEL static void NAME(shift_means)(const Target *target, const int16_t *offsets, const int16_t *pairs,
                             const float *scale, const float *mean, float *shifted) {
    const int64_t width = target->width, channels = target->channels;
    const __m256 unit = _mm256_set1_ps(target->offset_unit);
    for (int64_t c = 0; c < channels; c += LANES) {
        __m256i acc = _mm256_setzero_si256();
        const int16_t *b = pairs + c * width;
        for (int64_t j = 0; j < width; j += 2, b += 2 * LANES)
            acc = DOT(acc, load_pair(offsets + j), _mm256_loadu_si256((const __m256i *)b));
        __m256 sum = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_loadu_ps(scale + c));
        __m256 moved = _mm256_mul_ps(sum, unit);
        _mm256_storeu_ps(shifted + c, _mm256_add_ps(_mm256_loadu_ps(mean + c), moved));
    }
}

KERNEL static void NAME(stream)(const Target *target, const int16_t *coefficients, const int16_t *pairs,
                        const float *scale, const float *mean, int64_t first_angle,
                        int64_t base) {
    const int64_t heads = target->channels / target->head_dim, half = target->head_dim / 2;
    const int64_t whole = target->tokens - target->tokens % TILE;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t d = 0; d < half; d += LANES) {  /* these channels' rows stay in L1 */
            int64_t t = 0;
            for (; t < whole; t += TILE)
                NAME(whole_tile)(target, coefficients, pairs, scale, mean, first_angle, base, t, h, d);
            for (; t < target->tokens; t++)
                NAME(one)(target, coefficients, pairs, scale, mean, first_angle, base, t, h, d);
        }
}

/* The corrections of a stream's n refined rows (refinements x [n, width], rows of coded
   tokens token[0 .. n)), after its rows are written: each row's sums scaled, turned and added
   to the written row by add_put, TILE rows at a time while as many are left. */
KERNEL static void NAME(correct)(const Target *target, const int16_t *x, int64_t n,
                                 const int64_t *token, const int16_t *pairs, const float *scale,
                                 int64_t first_angle, int64_t base) {
    const int64_t width = target->width, head_dim = target->head_dim, half = head_dim / 2;
    const int64_t heads = target->channels / head_dim;
    __m256i sums[2 * TILE];
    for (int64_t h = 0; h < heads; h++)
        for (int64_t d = 0; d < half; d += LANES) {
            const int64_t c = h * head_dim + d;
            const int16_t *b = pairs + c * width;
            for (int64_t i = 0; i < n;) {
                const int64_t rows = n - i >= TILE ? TILE : 1;
                if (rows == TILE)
                    NAME(sum_tile)(x + i * width, width, b, 2 * LANES, half * width, sums);
                else
                    NAME(sum_one)(x + i * width, width, b, 2 * LANES, half * width, sums);
                for (int64_t j = 0; j < rows; j++) {
                    const int64_t t = token[i + j];
                    const int64_t angle = first_angle < 0 ? -1 : first_angle + t;
                    const int64_t at = base + (h * target->out_tokens + t) * head_dim + d;
                    add_put(target, sums[j], sums[TILE + j], scale + c, half, angle, d, at);
                }
                i += rows;
            }
        }
}

#undef NAME
#undef PASTE
#undef PASTE2
