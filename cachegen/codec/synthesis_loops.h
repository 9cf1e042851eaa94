/* The integer synthesis kernel's loops, compiled once per instruction set by synthesis.c:
   it defines KERNEL (the target attribute), DOT(acc, a, b) (acc plus the int32 sums of the
   int16 pair products of a and b, exact) and SUFFIX (appended to every name), then includes
   this file. The helpers they call (load_pair, put) are synthesis.c's AVX2 ones. */

#define PASTE2(a, b) a##b
#define PASTE(a, b) PASTE2(a, b)
#define NAME(f) PASTE(f, SUFFIX)

/* The int32 sums of 4 tokens (coefficients x, rows `width` apart) by the pair rows b (pair rows
   `step` apart): channels at b into sums[0..3], those `high` further into sums[4..7]. Named
   accumulators, not an array: with an array GCC copies every accumulator once per row. */
KERNEL static inline void NAME(sum_four)(const int16_t *x, int64_t width, const int16_t *b, int64_t step,
                                 int64_t high, __m256i sums[8]) {
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0,
            s7 = s0;
    for (int64_t j = 0; j < width; j += 2, b += step) {
        __m256i low = _mm256_loadu_si256((const __m256i *)b);
        __m256i up = _mm256_loadu_si256((const __m256i *)(b + high));
        __m256i a0 = load_pair(x + j), a1 = load_pair(x + width + j);
        __m256i a2 = load_pair(x + 2 * width + j), a3 = load_pair(x + 3 * width + j);
        s0 = DOT(s0, a0, low), s4 = DOT(s4, a0, up);
        s1 = DOT(s1, a1, low), s5 = DOT(s5, a1, up);
        s2 = DOT(s2, a2, low), s6 = DOT(s6, a2, up);
        s3 = DOT(s3, a3, low), s7 = DOT(s7, a3, up);
    }
    sums[0] = s0, sums[1] = s1, sums[2] = s2, sums[3] = s3;
    sums[4] = s4, sums[5] = s5, sums[6] = s6, sums[7] = s7;
}

/* The sums of one token, as sum_four's. */
KERNEL static inline void NAME(sum_one)(const int16_t *x, int64_t width, const int16_t *b, int64_t step,
                                int64_t high, __m256i sums[8]) {
    __m256i s0 = _mm256_setzero_si256(), s4 = s0;
    for (int64_t j = 0; j < width; j += 2, b += step) {
        __m256i a = load_pair(x + j);
        s0 = DOT(s0, a, _mm256_loadu_si256((const __m256i *)b));
        s4 = DOT(s4, a, _mm256_loadu_si256((const __m256i *)(b + high)));
    }
    sums[0] = s0, sums[4] = s4;
}

/* Tokens t .. t + n - 1 (n is 4 or 1) of channels c .. c + 7 and c + half .. c + half + 7 of
   head h, d = c - h * head_dim. */
KERNEL static inline void NAME(tile)(const Target *target, const int16_t *coefficients,
                             const int16_t *pairs, const float *scale, const float *mean,
                             int64_t first_angle, int64_t base, int64_t t, const int n,
                             int64_t h, int64_t d) {
    const int64_t width = target->width;
    const int64_t half = target->head_dim / 2, c = h * target->head_dim + d;
    const int16_t *x = coefficients + t * width, *b = pairs + c * width;  /* octet c / 8 */
    __m256i sums[8];
    if (n == TILE_TOKENS)
        NAME(sum_four)(x, width, b, 2 * LANES, half * width, sums);
    else
        NAME(sum_one)(x, width, b, 2 * LANES, half * width, sums);
    for (int i = 0; i < n; i++) {
        int64_t angle = first_angle < 0 ? -1 : first_angle + t + i;
        int64_t at = base + (h * target->out_tokens + t + i) * target->head_dim + d;
        put(target, sums[i], sums[4 + i], scale + c, mean + c, half, angle, d, at);
    }
}

KERNEL static void NAME(four)(const Target *target, const int16_t *coefficients, const int16_t *pairs,
                      const float *scale, const float *mean, int64_t first_angle, int64_t base,
                      int64_t t, int64_t h, int64_t d) {
    NAME(tile)(target, coefficients, pairs, scale, mean, first_angle, base, t, TILE_TOKENS, h, d);
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
    const int64_t whole = target->tokens - target->tokens % TILE_TOKENS;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t d = 0; d < half; d += LANES) {  /* these channels' rows stay in L1 */
            int64_t t = 0;
            for (; t < whole; t += TILE_TOKENS)
                NAME(four)(target, coefficients, pairs, scale, mean, first_angle, base, t, h, d);
            for (; t < target->tokens; t++)
                NAME(one)(target, coefficients, pairs, scale, mean, first_angle, base, t, h, d);
        }
}

#undef NAME
#undef PASTE
#undef PASTE2
