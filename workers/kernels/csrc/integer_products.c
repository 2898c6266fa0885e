/* Integer weights against 16-bit activations: y[M, N] = x[M, K] @ dequantize(w)[N, K]^T (+ bias), for the
 * tiled integer forms where the activations enter in bfloat16's precision (the bfloat16 plan): MXFP4
 * (gpt-oss's experts as published, quant.Mxfp4Weight), int4 (GGUF's Q4_0, Q4_1 and Q4_K, GPTQ/AWQ's,
 * --quantize int4: quant.Int4Weight) and int8 (GGUF's Q8_0 and Q6_K, --quantize int8: quant.Int8Weight).
 *
 * Why integers: on AVX2 the float forms (quant_kernels_avx2.c's FMAs over widened bf16 pairs) spend about 24
 * vector instructions on a pair of columns of a 4-bit tile, and a one-row product was bound by them, at twice
 * the time its bytes take to read. Here a pair costs about 12, and each further row 5: a 256-bit PSHUFB turns
 * an MXFP4 pair's 32 codes into twice their values (int4's codes are their values; int8's bytes are
 * sign-extended), shifts widen them to 16 bits, and VPMADDWD multiplies them with the activations' 16-bit
 * integers and adds each row's two products, all exact. The activations are quantized in blocks of 32:
 * d = max|x| / 32767, q = round(x / d). That and float32 accumulation are the only roundings: each block's
 * (int8 in groups of 16: each group's) integer sum is exact, then scaled and added to its row's float32 total
 * one after the other (int4's offset: its group's low times d times the block's sum of q, the exact sum of the
 * quantized activations; an int8 sum past 2^24 is rounded to float32 there). A value is carried to within
 * 2^-16 of its block's largest, where rounding it to bfloat16 (what the tiled float forms multiply) carries it
 * to 2^-9 of itself. (llama.cpp quantizes to 8 bits, Q8_0: 8% less time a one-row MXFP4 product here, at 2^-8
 * of the block's largest; docs/design-notes.md has the measurements.)
 *
 * One implementation for every CPU with a tiled kernel (AVX2 intrinsics; AVX-512 CPUs run them too), so every
 * such CPU gives the same numbers bit for bit, and a row's result does not depend on the rows beside it.
 *
 * Layout: quant_kernels.c's header. 4-bit values [N/16][K/2][16] bytes, a row's codes of a pair of columns in
 * one byte, the even column low; int8 values [N/16][K/2][2][16], the even column's 16 rows, then the odd
 * one's. G groups of a multiple of 32 columns (int8: or of 16, with K a multiple of 32). MXFP4's scales are
 * its e8m0 bytes [N/16][G][16] (2^(byte - 127); byte 0 is 2^-127, a float32 subnormal) and its lookup gives
 * 2e (e the e2m1 value), so a block's scale is halved to match; int4's are float32 scale and low [N/16][G][16]
 * (w = q * scale + low), int8's a float32 scale (w = q * scale). A pair's even and odd values of a row,
 * interleaved as 16-bit pairs, put rows 0..3 and 8..11 in one vector and 4..7 and 12..15 in the other: the
 * order the group scales are taken in and the totals put back from (apart, rows_in_order). */
#include "internal.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if TILED_KERNEL

/* CHUNK_BLOCKS: the blocks of a tile a product of many rows widens at a time, 128 KiB of 16-bit values, which
 * stay in L2 while every row passes over them (64 and 256 measured no better on Zen 3, 32 worse). */
enum {
    TILE = QUANT_TILE, BLOCK = ACTIVATION_BLOCK, PAIRS = BLOCK / 2, ROW_BLOCK = 4, LARGEST = 32767,
    CHUNK_BLOCKS = 128, SHORT_GROUP = 16
};

/* Block b of a row of x (float32, or bf16) as 4 vectors of float32, zero past column k. */
static inline void block_values(const void *x_row, int x_is_f32, int64_t k, int64_t b, __m256 v[4]) {
    const int64_t first = b * BLOCK;
    if (first + BLOCK <= k) {
        for (int i = 0; i < 4; i++)
            v[i] = x_is_f32 ? _mm256_loadu_ps((const float *)x_row + first + 8 * i)
                            : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                                  (const __m128i *)((const uint16_t *)x_row + first + 8 * i))), 16));
        return;
    }
    float values[BLOCK];
    for (int j = 0; j < BLOCK; j++)
        values[j] = first + j >= k ? 0.0f
                    : x_is_f32     ? ((const float *)x_row)[first + j]
                                   : bf16_to_f32(((const uint16_t *)x_row)[first + j]);
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(values + 8 * i);
}

/* roundf of each lane (halves away from zero): the truncation, then one away from zero where the part cut off
 * (exact) is a half or more. */
static inline __m256 round_half_away(__m256 t) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 whole = _mm256_round_ps(t, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 cut = _mm256_andnot_ps(sign, _mm256_sub_ps(t, whole));
    const __m256 far = _mm256_cmp_ps(cut, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    const __m256 step = _mm256_or_ps(_mm256_and_ps(t, sign), _mm256_set1_ps(1.0f));
    return _mm256_add_ps(whole, _mm256_and_ps(far, step));
}

/* One row of x (float32, or bf16) as 16-bit blocks: each pair of columns' two values in a 32-bit word (the
 * even column low, VPMADDWD's order: the values in column order), and its stats: each block's d, then each
 * block's sum of q (exact in a float: at most 2^20). A block holding a NaN or an infinity gets d = NaN, so the
 * rows it reaches come out NaN, as a float product's would. */
static void quantize_row(const void *x_row, int x_is_f32, int64_t k, int64_t k_padded, uint32_t *pairs,
                         float *stats) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    float *d = stats, *sums = stats + k_padded / BLOCK;
    for (int64_t b = 0; b < k_padded / BLOCK; b++) {
        __m256 v[4], finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), largest = _mm256_setzero_ps();
        block_values(x_row, x_is_f32, k, b, v);
        for (int i = 0; i < 4; i++) {
            const __m256 size = _mm256_and_ps(v[i], magnitude);
            finite = _mm256_and_ps(finite, _mm256_cmp_ps(size, _mm256_set1_ps(INFINITY), _CMP_LT_OQ));
            largest = _mm256_max_ps(largest, size);
        }
        __m256i *out = (__m256i *)(pairs + b * PAIRS);
        if (_mm256_movemask_ps(finite) != 0xFF) {
            _mm256_storeu_si256(out, _mm256_setzero_si256()), _mm256_storeu_si256(out + 1, _mm256_setzero_si256());
            d[b] = NAN, sums[b] = 0.0f;
            continue;
        }
        __m128 half = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
        half = _mm_max_ps(half, _mm_movehl_ps(half, half));
        const float top = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
        const float scale = top / (float)LARGEST, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        /* Below 2^-128 a scale's inverse overflows: such a block divides by it instead, and its subnormal
         * scale's rounding can take a value just past LARGEST, which is clamped. */
        const int tiny = isinf(inverse);
        __m256i q[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            const __m256 t = tiny ? _mm256_div_ps(v[i], _mm256_set1_ps(scale))
                                  : _mm256_mul_ps(v[i], _mm256_set1_ps(inverse));
            q[i] = _mm256_cvttps_epi32(round_half_away(t));
            q[i] = _mm256_max_epi32(_mm256_min_epi32(q[i], _mm256_set1_epi32(LARGEST)), _mm256_set1_epi32(-LARGEST));
            sum = _mm256_add_epi32(sum, q[i]);
        }
        /* packs works within 128-bit lanes: the 64-bit quarters back in column order */
        _mm256_storeu_si256(out, _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
        _mm256_storeu_si256(out + 1, _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
        __m128i total = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        total = _mm_add_epi32(total, _mm_shuffle_epi32(total, 0x4E));
        total = _mm_add_epi32(total, _mm_shuffle_epi32(total, 0xB1));
        d[b] = scale, sums[b] = (float)_mm_cvtsi128_si32(total);
    }
}

/* A pair of columns of a tile's 16 rows as 16-bit integers (MXFP4: twice the codes' e2m1 values; int4: the
 * codes): [0] the even column's and the odd column's of rows 0..3 and 8..11 interleaved, [1] of rows 4..7
 * and 12..15. One lane-crossing shuffle spreads the bytes to words, one PSHUFB looks MXFP4's 32 codes up,
 * shifts widen them. */
static inline __attribute__((always_inline)) void pair_values(const int kind, const uint8_t *pair, __m256i out[2]) {
    const __m256i table = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                           0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    if (kind == TILED_INT8) { /* the even column's 16 rows, then the odd one's */
        const __m256i even = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)pair));
        const __m256i odd = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(pair + TILE)));
        out[0] = _mm256_unpacklo_epi16(even, odd), out[1] = _mm256_unpackhi_epi16(even, odd);
        return;
    }
    __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)pair));
    /* the low nibble stays in the low byte, the high one moves to the high byte */
    __m256i codes = _mm256_and_si256(_mm256_or_si256(words, _mm256_slli_epi16(words, 4)), _mm256_set1_epi16(0x0F0F));
    __m256i even, odd;
    if (kind == TILED_MXFP4) {
        __m256i values = _mm256_shuffle_epi8(table, codes);
        even = _mm256_srai_epi16(_mm256_slli_epi16(values, 8), 8), odd = _mm256_srai_epi16(values, 8);
    } else {
        even = _mm256_and_si256(codes, _mm256_set1_epi16(0x00FF)), odd = _mm256_srli_epi16(codes, 8);
    }
    out[0] = _mm256_unpacklo_epi16(even, odd), out[1] = _mm256_unpackhi_epi16(even, odd);
}

/* A tile's 16 float32 values (a row each) in the order the sums hold the rows: 0..3 and 8..11, 4..7 and
 * 12..15. */
static inline void apart(__m256 first, __m256 second, __m256 out[2]) {
    out[0] = _mm256_permute2f128_ps(first, second, 0x20), out[1] = _mm256_permute2f128_ps(first, second, 0x31);
}

static inline void floats_apart(const float *tile, __m256 out[2]) {
    apart(_mm256_loadu_ps(tile), _mm256_loadu_ps(tile + 8), out);
}

/* A tile's 16 e8m0 scales as float32, apart. A byte shifted into a float's exponent is its power of two, but
 * for byte 0's subnormal 2^-127. */
static inline void scales_apart(const uint8_t *tile, __m256 out[2]) {
    const __m256i smallest = _mm256_set1_epi32(0x00400000); /* 2^-127 */
    __m256 first = _mm256_castsi256_ps(_mm256_max_epi32(
        _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)tile)), 23), smallest));
    __m256 second = _mm256_castsi256_ps(_mm256_max_epi32(
        _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(tile + 8))), 23), smallest));
    apart(first, second, out);
}

/* apart undone: rows 0..7 and 8..15. */
static inline void rows_in_order(__m256 v[2]) {
    __m256 low = _mm256_permute2f128_ps(v[0], v[1], 0x20), high = _mm256_permute2f128_ps(v[0], v[1], 0x31);
    v[0] = low, v[1] = high;
}

/* Where tile t of a weight starts. */
typedef struct {
    const uint8_t *values;
    const void *scale; /* MXFP4: uint8 e8m0; int4: float32 */
    const float *low;  /* int4 only */
} TileWeights;

/* Bytes of a pair of columns of a tile: int8's two columns of 16 rows, a nibble form's one byte a row. */
static inline int64_t pair_bytes(const int kind) { return kind == TILED_INT8 ? 2 * TILE : TILE; }

/* One tile against `count` consecutive quantized rows from `first`: blocks from..to-1 added to each row's totals,
 * block after block. A pair's values are widened here, or read from `widened` (the pairs from block `from` on,
 * widened once for every row block of a long product). */
static inline __attribute__((always_inline)) void block_rows(const int kind, const int run, TileWeights w,
                                                            const __m256i *widened,
                                                            const uint32_t *pairs, const float *stats,
                                                            int64_t first, const int count, int64_t k_padded,
                                                            int64_t group, int64_t from, int64_t to,
                                                            __m256 total[][2]) {
    const int64_t blocks = k_padded / BLOCK, stride = k_padded / 2;
    const uint32_t *x = pairs + first * stride;
    for (int64_t r = from * PAIRS / run; r < to * PAIRS / run; r++) {
        __m256i sum[ROW_BLOCK][2];
        for (int i = 0; i < count; i++) sum[i][0] = sum[i][1] = _mm256_setzero_si256();
        for (int64_t p = r * run; p < (r + 1) * run; p++) {
            __m256i v[2];
            if (widened != NULL)
                v[0] = widened[2 * (p - from * PAIRS)], v[1] = widened[2 * (p - from * PAIRS) + 1];
            else
                pair_values(kind, w.values + p * pair_bytes(kind), v);
            for (int i = 0; i < count; i++) {
                const __m256i xx = _mm256_set1_epi32((int)x[i * stride + p]);
                for (int h = 0; h < 2; h++) sum[i][h] = _mm256_add_epi32(sum[i][h], _mm256_madd_epi16(v[h], xx));
            }
        }
        const int64_t g = 2 * r * run / group, b = 2 * r * run / BLOCK;
        __m256 scale[2], low[2];
        if (kind == TILED_MXFP4) {
            scales_apart((const uint8_t *)w.scale + g * TILE, scale);
        } else {
            floats_apart((const float *)w.scale + g * TILE, scale);
            if (kind == TILED_INT4) floats_apart(w.low + g * TILE, low);
        }
        for (int i = 0; i < count; i++) {
            const float *d = stats + (first + i) * 2 * blocks + b, *q_sum = d + blocks;
            /* MXFP4's values are doubled */
            const __m256 block_d = _mm256_set1_ps(kind == TILED_MXFP4 ? 0.5f * *d : *d);
            for (int h = 0; h < 2; h++) {
                total[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i][h]), _mm256_mul_ps(scale[h], block_d),
                                              total[i][h]);
                if (kind == TILED_INT4) /* the offset, times the quantized activations' sum: d * sum(q) */
                    total[i][h] = _mm256_fmadd_ps(low[h], _mm256_set1_ps(*d * *q_sum), total[i][h]);
            }
        }
    }
}

/* block_rows with `count` as a constant, which keeps the sums in registers. */
static inline __attribute__((always_inline)) void rows_of(const int kind, const int run, TileWeights w,
                                                         const __m256i *widened, const uint32_t *pairs,
                                                         const float *stats, int64_t first, int64_t count,
                                                         int64_t k_padded, int64_t group, int64_t from, int64_t to,
                                                         __m256 total[][2]) {
    switch (count) {
#define ROWS_CASE(c) \
    case c: block_rows(kind, run, w, widened, pairs, stats, first, c, k_padded, group, from, to, total); break;
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
#undef ROWS_CASE
    }
}

/* Row `row` of y (y_stride apart), columns column..column+15 (fewer at the edge): v (+ bias), as float32 (added
 * to y's values with `accumulate`) or bf16. */
static void store_row(void *y, int y_is_f32, int64_t y_stride, int accumulate, int64_t n, int64_t row,
                      int64_t column, const __m256 v[2], const float *bias) {
    float lanes[TILE];
    _mm256_storeu_ps(lanes, v[0]), _mm256_storeu_ps(lanes + 8, v[1]);
    const int64_t width = n - column < TILE ? n - column : TILE;
    for (int64_t j = 0; j < width; j++) {
        const float out = bias != NULL ? lanes[j] + bias[column + j] : lanes[j];
        if (y_is_f32) {
            float *at = (float *)y + row * y_stride + column + j;
            *at = accumulate ? *at + out : out;
        } else {
            ((uint16_t *)y)[row * y_stride + column + j] = f32_to_bf16(out);
        }
    }
}

/* A thread's scratch for long products: a chunk's widened pairs and every row's totals between chunks, grown as
 * needed and kept for the thread's next product (OpenMP's threads persist). */
static _Thread_local struct {
    __m256i *widened;
    __m256 *totals;
    int64_t rows;
} scratch;

static __m256 *totals_for(int64_t rows) {
    if (scratch.rows < rows) {
        free(scratch.totals);
        scratch.totals = aligned_alloc(32, (size_t)rows * 2 * sizeof(__m256));
        scratch.rows = scratch.totals != NULL ? rows : 0;
    }
    if (scratch.widened == NULL)
        scratch.widened = aligned_alloc(32, (size_t)CHUNK_BLOCKS * PAIRS * 2 * sizeof(__m256i));
    return scratch.widened != NULL ? scratch.totals : NULL;
}

static inline __attribute__((always_inline)) void block_tile(const int kind, const int run, TileWeights w, int64_t t,
                                                            const uint32_t *pairs, const float *stats, int64_t m,
                                                            int64_t n, int64_t k_padded, int64_t group,
                                                            const float *bias, void *y, int y_is_f32,
                                                            int64_t y_stride, int accumulate) {
    const int64_t at = t * (k_padded / group) * TILE; /* the tile's first group scale */
    const int64_t blocks = k_padded / BLOCK;
    w.values += t * (k_padded / 2) * pair_bytes(kind);
    w.scale = kind == TILED_MXFP4 ? (const void *)((const uint8_t *)w.scale + at)
                                  : (const void *)((const float *)w.scale + at);
    w.low = kind == TILED_INT4 ? w.low + at : NULL;
    /* Past one block of rows, each chunk of the tile's 4-bit pairs is widened once for all of them, not once a
     * row block (22 instructions a pair and block of 4 rows, not 28): the same sums in the same order, so the
     * same bits. int8's bytes widen in 4 instructions, not 8, and storing and reading them back gained only
     * past 16 rows (Q6_K's groups of 16 lost up to 16, Q8_0's up to 8; 9% and 24% less time at 128). Where
     * the scratch cannot be had, the rows go block by block as a short product's do. */
    const int64_t widened_past = kind == TILED_INT8 ? 4 * ROW_BLOCK : ROW_BLOCK;
    __m256 *totals = m > widened_past ? totals_for(m) : NULL;
    if (totals == NULL) {
        for (int64_t first = 0; first < m; first += ROW_BLOCK) {
            __m256 total[ROW_BLOCK][2];
            const int64_t count = m - first < ROW_BLOCK ? m - first : ROW_BLOCK;
            for (int64_t i = 0; i < count; i++) total[i][0] = total[i][1] = _mm256_setzero_ps();
            rows_of(kind, run, w, NULL, pairs, stats, first, count, k_padded, group, 0, blocks, total);
            for (int64_t i = 0; i < count; i++) {
                rows_in_order(total[i]);
                store_row(y, y_is_f32, y_stride, accumulate, n, first + i, t * TILE, total[i], bias);
            }
        }
        return;
    }
    for (int64_t i = 0; i < 2 * m; i++) totals[i] = _mm256_setzero_ps();
    for (int64_t from = 0; from < blocks; from += CHUNK_BLOCKS) {
        const int64_t to = blocks - from < CHUNK_BLOCKS ? blocks : from + CHUNK_BLOCKS;
        for (int64_t p = from * PAIRS; p < to * PAIRS; p++)
            pair_values(kind, w.values + p * pair_bytes(kind), scratch.widened + 2 * (p - from * PAIRS));
        for (int64_t first = 0; first < m; first += ROW_BLOCK) {
            const int64_t count = m - first < ROW_BLOCK ? m - first : ROW_BLOCK;
            rows_of(kind, run, w, scratch.widened, pairs, stats, first, count, k_padded, group, from, to,
                    (__m256(*)[2])(totals + 2 * first));
        }
    }
    for (int64_t i = 0; i < m; i++) {
        rows_in_order(totals + 2 * i);
        store_row(y, y_is_f32, y_stride, accumulate, n, i, t * TILE, totals + 2 * i, bias);
    }
}

static inline __attribute__((always_inline)) TileWeights weights_of(const Tiled *w) {
    const TileWeights n = {(const uint8_t *)w->values, w->scale, w->low};
    return n;
}

/* block_tile with the kind and the run of pairs summed as integers as constants (a block, or int8's group where
 * it is shorter: Q6_K's 16), each its own function: the compiler's budget for inlining is a function's. */
#define TILE_FUNCTION(NAME, KIND, RUN)                                                                            \
    static __attribute__((noinline)) void NAME(TileWeights w, int64_t t, const uint32_t *pairs, const float *stats,   \
                                               int64_t m, int64_t n, int64_t k_padded, int64_t group,             \
                                               const float *bias, void *y, int y_is_f32, int64_t y_stride,        \
                                               int accumulate) {                                                  \
        block_tile(KIND, RUN, w, t, pairs, stats, m, n, k_padded, group, bias, y, y_is_f32, y_stride, accumulate); \
    }
TILE_FUNCTION(mxfp4_tile, TILED_MXFP4, PAIRS)
TILE_FUNCTION(int4_tile, TILED_INT4, PAIRS)
TILE_FUNCTION(int8_tile, TILED_INT8, PAIRS)
TILE_FUNCTION(int8_short_tile, TILED_INT8, SHORT_GROUP / 2)
#undef TILE_FUNCTION

static void any_tile(int kind, TileWeights w, int64_t t, const uint32_t *pairs, const float *stats, int64_t m,
                     int64_t n, int64_t k_padded, int64_t group, const float *bias, void *y, int y_is_f32,
                     int64_t y_stride, int accumulate) {
    void (*tile)(TileWeights, int64_t, const uint32_t *, const float *, int64_t, int64_t, int64_t, int64_t,
                 const float *, void *, int, int64_t, int) =
        kind == TILED_MXFP4  ? mxfp4_tile
        : kind == TILED_INT4 ? int4_tile
        : group < BLOCK      ? int8_short_tile
                             : int8_tile;
    tile(w, t, pairs, stats, m, n, k_padded, group, bias, y, y_is_f32, y_stride, accumulate);
}

/* internal.h: whether w computes here. */
int integer_tiled(const Tiled *w) {
    if (w->kind == TILED_MXFP4) return 1;
    if (w->split || w->k_padded % BLOCK) return 0;
    return (w->kind == TILED_INT4 && w->group % BLOCK == 0) ||
           (w->kind == TILED_INT8 && (w->group % BLOCK == 0 || w->group == SHORT_GROUP));
}

/* internal.h: the fused layer's halves of integer_matmul. */
void integer_prepare_row(const Tiled *w, const float *x, int64_t k, uint32_t *pairs, float *stats) {
    quantize_row(x, 1, k, w->k_padded, pairs, stats);
}

void integer_product(const Tiled *w, int64_t t, const uint32_t *pairs, const float *stats, int64_t inputs, int64_t n,
                     const float *bias, float *y, int64_t y_stride, int accumulate) {
    any_tile((int)w->kind, weights_of(w), t, pairs, stats, inputs, n, w->k_padded, w->group, bias, y, 1, y_stride,
             accumulate);
}

/* internal.h: x, m rows of k (bf16, or float32 where x_is_f32; x_stride apart), times w; y: m x n of x's dtype. */
int integer_matmul(const Tiled *tiled, const void *x, int x_is_f32, int64_t m, int64_t k, int64_t x_stride,
                   int64_t n, const float *bias, void *y, uint32_t *pairs, float *block_stats) {
    const int kind = (int)tiled->kind;
    const int64_t k_padded = tiled->k_padded, group = tiled->group;
    if ((kind == TILED_MXFP4 && group != BLOCK) || k_padded % group || k > k_padded) return -2;
    const int64_t blocks = k_padded / BLOCK, tiles = (n + TILE - 1) / TILE, size = x_is_f32 ? 4 : 2;
    const TileWeights w = weights_of(tiled);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++)
            quantize_row((const char *)x + i * x_stride * size, x_is_f32, k, k_padded, pairs + i * (k_padded / 2),
                         block_stats + i * 2 * blocks);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            any_tile(kind, w, t, pairs, block_stats, m, n, k_padded, group, bias, y, x_is_f32, n, 0);
        }
    }
    return 0;
}

#else

int integer_tiled(const Tiled *w) { return 0; }
void integer_prepare_row(const Tiled *w, const float *x, int64_t k, uint32_t *pairs, float *stats) {}
void integer_product(const Tiled *w, int64_t t, const uint32_t *pairs, const float *stats, int64_t inputs, int64_t n,
                     const float *bias, float *y, int64_t y_stride, int accumulate) {}

int integer_matmul(const Tiled *tiled, const void *x, int x_is_f32, int64_t m, int64_t k, int64_t x_stride,
                   int64_t n, const float *bias, void *y, uint32_t *pairs, float *block_stats) {
    return -1;
}

#endif
