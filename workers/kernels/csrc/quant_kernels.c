/* Weight-only int8 / int4 matmul for CPU: y[M, N] = x[M, K] @ dequantize(w)[N, K]^T (+ bias).
 *
 * All forms run on AVX512-BF16's VDPBF16PS, which multiplies pairs of bf16 values into float32 lanes:
 * 4- and 8-bit integers are exact in bf16 and the products of bf16 values are exact in float32, so the only
 * rounding is float32 accumulation (and the output's dtype). Vectors run along the output rows:
 * a tile is 16 rows of the weight, and one instruction adds x[m][k..k+1] . w[16 rows][k..k+1] into 16
 * float32 lanes. Each unpacked weight vector is used for up to 8 activation rows held in registers,
 * and a tile (16 rows x K) stays in L1 while all rows of x pass over it.
 *
 * Layouts (N padded to tiles of 16 with zero rows, K padded to whole groups with zero columns; G groups):
 *   int8:  values [N/16][K/2][2][16] int8 (for a pair of columns, 16 rows of the first then of the
 *          second), scale [N/16][G][16] float32: w = value * scale of its group.
 *   int4:  values [N/16][K/2][16] bytes, low nibble column 2p and high nibble column 2p+1, each 0..15;
 *          scale and low [N/16][G][16] float32: w = q * scale + low.
 *   mxfp4: values as int4's, each nibble an e2m1 code (bit 3 the sign, bits 0..2 the magnitude's index in
 *          0, 0.5, 1, 1.5, 2, 3, 4, 6); scale [N/16][G][16] e8m0 bytes (MXFP4's power of two): w = e2m1 *
 *          2^(scale - 127). integer_products.c computes it, against activations quantized to 16 bits.
 *   bf16:  values [N/16][K/2][16][2]: each row's pair of columns as VDPBF16PS reads it; one group, no scale.
 * int8 values become bf16 through float32 (exact); int4 values q become the bf16 number 128 + q by
 * OR-ing the bf16 bits of 128 (0x4300) into the nibble, two integer ops for 32 weights, and the group's
 * sum of x times 128 is taken off afterwards.
 *
 * Activations: bf16 rows are used as they are. A float32 row x is split into two bf16 rows, hi = bf16(x)
 * and lo = bf16(x - hi), and its result is the sum of theirs: x is then carried to about 2^-17 of
 * itself (hi + lo holds 16 significant bits), against 2^-8 for rounding x to bf16. An int8 or int4 product
 * whose activations would be bf16 (not split) runs in integer_products.c instead, as MXFP4's always does:
 * integer products against 16-bit activations (integer_tiled says which; tiled_prepare_row and tiled_product
 * hand it over).
 *
 * Without AVX512-BF16 (an AVX2-only CPU, or AVX-512 without BF16) quant_kernels_avx2.c computes the same
 * layouts with FMAs and the same numbers; this file keeps what both share (preparing the rows, the entry
 * points). Without AVX2 + FMA either, the entry points return -1 and the caller uses torch's kernels.
 */
#include "internal.h"

#include <stdint.h>
#include <string.h>

int tiled_kernel_isa(void) {
    _Static_assert(TILED_ISA_AVX2 == 1 && TILED_ISA_AVX512_BF16 == 2, "internal.h's TILED_KERNEL numbers");
    return TILED_KERNEL;
}

#if TILED_KERNEL

#define TILE QUANT_TILE

/* One input row (bf16, or float32: rounded to bf16, and with `split` its remainder too, k_padded apart) ->
 * bf16 row(s) of k_padded in `out`, zero-padded; and, where `sums` is not null (int4), each prepared row's
 * sum per group, `groups` apart. */
static inline void prepare_row(const void *x_row, int x_is_f32, int split, int64_t k, int64_t k_padded,
                               int64_t group, uint16_t *out, float *sums) {
    int64_t per_input = x_is_f32 && split ? 2 : 1, groups = k_padded / group;
    uint16_t *hi = out, *lo = out + k_padded;
    if (x_is_f32) {
        const float *src = (const float *)x_row;
        for (int64_t j = 0; j < k; j++) {
            uint16_t h = f32_to_bf16(src[j]);
            hi[j] = h;
            if (split) lo[j] = f32_to_bf16(src[j] - bf16_to_f32(h));
        }
    } else {
        memcpy(hi, x_row, k * sizeof(uint16_t));
    }
    for (int64_t r = 0; r < per_input; r++) {
        uint16_t *row = hi + r * k_padded;
        memset(row + k, 0, (k_padded - k) * sizeof(uint16_t));
        if (sums == NULL) continue;
        for (int64_t g = 0; g < groups; g++) {
            float sum = 0.0f;
            for (int64_t j = g * group; j < (g + 1) * group; j++) sum += bf16_to_f32(row[j]);
            sums[r * groups + g] = sum;
        }
    }
}

/* x (bf16 or float32, rows x_stride apart) -> bf16 rows of k_padded in `rows` (float32 input: hi, lo
 * interleaved), zero-padded; and, for int4, each row's sum per group in `sums` [rows][groups]. */
static void prepare_rows(const void *x, int x_is_f32, int split, int64_t m, int64_t k, int64_t x_stride,
                         int64_t k_padded, int64_t group, uint16_t *rows, float *sums) {
    int64_t per_input = x_is_f32 && split ? 2 : 1, groups = k_padded / group, size = x_is_f32 ? 4 : 2;
#pragma omp parallel for schedule(static) if (m >= 32)
    for (int64_t i = 0; i < m; i++)
        prepare_row((const char *)x + i * x_stride * size, x_is_f32, split, k, k_padded, group,
                    rows + i * per_input * k_padded, sums == NULL ? NULL : sums + i * per_input * groups);
}

#if TILED_KERNEL == 2
#define ROW_BLOCK 8

static inline __m512i unpack_int8(const int8_t *pair) {
    __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)pair)));
    __m512 second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(pair + TILE))));
    /* small integers have no mantissa bits below bf16's: the top halves are exact. 0xF8 = a | (b & c). */
    return _mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_castps_si512(first), 16),
                                     _mm512_castps_si512(second), _mm512_set1_epi32((int)0xFFFF0000u), 0xF8);
}

static inline __m512i unpack_int4(const uint8_t *pair) {
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)pair));
    __m512i spread = _mm512_or_si512(bytes, _mm512_slli_epi32(bytes, 12)); /* high nibble to bits 16..19 */
    /* 0xEA = (a & b) | c: keep the two nibbles, add the bits of bf16 128 above each. */
    return _mm512_ternarylogic_epi32(spread, _mm512_set1_epi32(0x000F000F), _mm512_set1_epi32(0x43004300), 0xEA);
}

/* One tile (16 output rows) for `count` consecutive prepared rows starting at `first`. Each lane's sum runs
 * over the pairs of inputs in order, one group after another, whatever `count` and `first` are: a row's
 * result does not depend on the rows beside it. */
static inline __attribute__((always_inline)) void tile_rows(
        int64_t kind, const void *tile_values, const float *tile_scale, const float *tile_low,
        const uint16_t *rows, const float *sums, int64_t first, const int count, int64_t k_padded,
        int64_t group, __m512 *total) {
    const int64_t groups = k_padded / group, pairs_per_group = group / 2;
    const uint32_t *x_pairs = (const uint32_t *)rows;
    for (int i = 0; i < count; i++) total[i] = _mm512_setzero_ps();
    if (kind == TILED_BF16) { /* one group, no scale: the pairs are stored as the instruction reads them */
        for (int64_t p = 0; p < k_padded / 2; p++) {
            __m512i w = _mm512_loadu_si512((const uint16_t *)tile_values + p * 2 * TILE);
            for (int i = 0; i < count; i++) {
                __m512i xx = _mm512_set1_epi32((int)x_pairs[(first + i) * (k_padded / 2) + p]);
                total[i] = _mm512_dpbf16_ps(total[i], (__m512bh)xx, (__m512bh)w);
            }
        }
        return;
    }
    const int is_int4 = kind == TILED_INT4;
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc[ROW_BLOCK];
        for (int i = 0; i < count; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t p = g * pairs_per_group; p < (g + 1) * pairs_per_group; p++) {
            __m512i w = is_int4 ? unpack_int4((const uint8_t *)tile_values + p * TILE)
                                : unpack_int8((const int8_t *)tile_values + p * 2 * TILE);
            for (int i = 0; i < count; i++) {
                __m512i xx = _mm512_set1_epi32((int)x_pairs[(first + i) * (k_padded / 2) + p]);
                acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)xx, (__m512bh)w);
            }
        }
        __m512 scale = _mm512_loadu_ps(tile_scale + g * TILE);
        if (is_int4) {
            __m512 low = _mm512_loadu_ps(tile_low + g * TILE);
            for (int i = 0; i < count; i++) {
                float sum = sums[(first + i) * groups + g];
                __m512 dot = _mm512_sub_ps(acc[i], _mm512_set1_ps(128.0f * sum)); /* x . q */
                total[i] = _mm512_fmadd_ps(scale, dot, total[i]);
                total[i] = _mm512_fmadd_ps(low, _mm512_set1_ps(sum), total[i]);
            }
        } else {
            for (int i = 0; i < count; i++) total[i] = _mm512_fmadd_ps(scale, acc[i], total[i]);
        }
    }
}

static inline void store_row(void *y, int y_is_f32, int64_t y_stride, int accumulate, int64_t row, int64_t n,
                             int64_t column, __m512 v, const float *bias) {
    __mmask16 mask = n - column >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - column)) - 1);
    if (bias != NULL) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + column));
    if (y_is_f32) {
        float *at = (float *)y + row * y_stride + column;
        if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, at), v);
        _mm512_mask_storeu_ps(at, mask, v);
    } else {
        __m256i packed = (__m256i)_mm512_cvtneps_pbh(v);
        _mm256_mask_storeu_epi16((uint16_t *)y + row * y_stride + column, mask, packed);
    }
}

/* internal.h: tile `t` of `w` against every prepared row. */
void tile_product(const Tiled *w, int64_t t, const uint16_t *rows, const float *sums, int64_t prepared,
                  int64_t per_input, int64_t n, const float *bias, void *y, int y_is_f32, int64_t y_stride,
                  int accumulate) {
    const int64_t k_padded = w->k_padded, group = w->group;
    const TileAt at = tile_at(w, t);
    const void *tile_values = at.values;
    const float *tile_scale = at.scale, *tile_low = at.low;
    for (int64_t first = 0; first < prepared; first += ROW_BLOCK) {
        __m512 total[ROW_BLOCK];
        int64_t count = prepared - first < ROW_BLOCK ? prepared - first : ROW_BLOCK;
        /* constant counts let the compiler keep the accumulators in registers */
        switch (count) {
#define ROWS_CASE(c) case c: tile_rows(w->kind, tile_values, tile_scale, tile_low, rows, sums, first, c, \
                                       k_padded, group, total); break;
            ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
            ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
#undef ROWS_CASE
        }
        for (int64_t i = 0; i < count; i += per_input) {
            __m512 v = per_input == 2 ? _mm512_add_ps(total[i], total[i + 1]) : total[i];
            store_row(y, y_is_f32, y_stride, accumulate, (first + i) / per_input, n, t * TILE, v, bias);
        }
    }
}

#endif

void tiled_prepare_row(const Tiled *w, const float *x, int64_t k, uint16_t *out, float *sums) {
    if (integer_tiled(w)) {
        integer_prepare_row(w, x, k, (uint32_t *)out, sums);
        return;
    }
    prepare_row(x, 1, (int)w->split, k, w->k_padded, w->group, out, w->kind == TILED_INT4 ? sums : NULL);
}

void tiled_product(const Tiled *w, int64_t t, const uint16_t *rows, const float *sums, int64_t inputs, int64_t n,
                   const float *bias, float *y, int64_t y_stride, int accumulate) {
    if (integer_tiled(w)) {
        integer_product(w, t, (const uint32_t *)rows, sums, inputs, n, bias, y, y_stride, accumulate);
        return;
    }
    const int64_t per_input = w->split ? 2 : 1;
    tile_product(w, t, rows, sums, per_input * inputs, per_input, n, bias, y, 1, y_stride, accumulate);
}

static int quant_matmul(const Tiled *w, const void *x, int x_is_f32, int64_t m, int64_t k, int64_t x_stride,
                        int64_t n, const float *bias, void *y, uint16_t *rows, float *sums) {
    Tiled as_read = *w;
    as_read.split = x_is_f32 && w->split; /* bf16 rows are never split */
    if (integer_tiled(&as_read))
        return integer_matmul(&as_read, x, x_is_f32, m, k, x_stride, n, bias, y, (uint32_t *)rows, sums);
    if (w->k_padded % w->group || w->group % 2 || k > w->k_padded) return -2;
    prepare_rows(x, x_is_f32, (int)w->split, m, k, x_stride, w->k_padded, w->group, rows,
                 w->kind == TILED_INT4 ? sums : NULL);
    const int64_t per_input = x_is_f32 && w->split ? 2 : 1, tiles = (n + TILE - 1) / TILE;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        tile_product(w, t, rows, sums, m * per_input, per_input, n, bias, y, x_is_f32, n, 0);
    return 0;
}

#else

void tiled_prepare_row(const Tiled *w, const float *x, int64_t k, uint16_t *out, float *sums) {}
void tiled_product(const Tiled *w, int64_t t, const uint16_t *rows, const float *sums, int64_t inputs, int64_t n,
                   const float *bias, float *y, int64_t y_stride, int accumulate) {}

static int quant_matmul(const Tiled *w, const void *x, int x_is_f32, int64_t m, int64_t k, int64_t x_stride,
                        int64_t n, const float *bias, void *y, uint16_t *rows, float *sums) {
    return -1;
}

#endif

/* x: m rows of k (bf16, or float32 when x_is_f32, split into hi and lo rows where `split`; y has x's dtype,
 * m x n contiguous); rows: scratch of (x_is_f32 ? 2 : 1) * m * k_padded bf16; sums: (x_is_f32 ? 2 : 1) * m
 * * k_padded / group floats, and at least 2 * m * k_padded / ACTIVATION_BLOCK where the product is integer_tiled's
 * (int8 and int4 with unsplit rows, MXFP4: integer_products.c's integer products). */
int int8_matmul(const void *x, int x_is_f32, int split, int64_t m, int64_t k, int64_t x_stride,
                const int8_t *values, const float *scale, int64_t n, int64_t k_padded, int64_t group,
                const float *bias, void *y, uint16_t *rows, float *sums) {
    Tiled w = {values, scale, NULL, TILED_INT8, k_padded, group, split};
    return quant_matmul(&w, x, x_is_f32, m, k, x_stride, n, bias, y, rows, sums);
}

int int4_matmul(const void *x, int x_is_f32, int split, int64_t m, int64_t k, int64_t x_stride,
                const uint8_t *values, const float *scale, const float *low, int64_t n, int64_t k_padded,
                int64_t group, const float *bias, void *y, uint16_t *rows, float *sums) {
    Tiled w = {values, scale, low, TILED_INT4, k_padded, group, split};
    return quant_matmul(&w, x, x_is_f32, m, k, x_stride, n, bias, y, rows, sums);
}

/* scale: e8m0 bytes */
int mxfp4_matmul(const void *x, int x_is_f32, int split, int64_t m, int64_t k, int64_t x_stride,
                 const uint8_t *values, const uint8_t *scale, int64_t n, int64_t k_padded, int64_t group,
                 const float *bias, void *y, uint16_t *rows, float *sums) {
    Tiled w = {values, (const float *)scale, NULL, TILED_MXFP4, k_padded, group, split};
    return quant_matmul(&w, x, x_is_f32, m, k, x_stride, n, bias, y, rows, sums);
}

int bf16_matmul(const void *x, int x_is_f32, int split, int64_t m, int64_t k, int64_t x_stride,
                const uint16_t *values, int64_t n, int64_t k_padded, const float *bias, void *y, uint16_t *rows) {
    Tiled w = {values, NULL, NULL, TILED_BF16, k_padded, k_padded, split};
    return quant_matmul(&w, x, x_is_f32, m, k, x_stride, n, bias, y, rows, NULL);
}
