/* The tiled int8 / int4 / bf16 forms on AVX2 + FMA, for CPUs without AVX512-BF16 (Zen 3, Haswell to
 * Alder Lake, and AVX-512 CPUs without BF16): quant_kernels.c's layouts (its header) read as they are, so
 * quant.py packs one form for both, and the same numbers as its VDPBF16PS kernel.
 *
 * Why the same numbers: VDPBF16PS adds a pair's two products into a float32 lane one after the other, the
 * odd column's first, each addition rounded to nearest even (Intel's pseudo-code; checked on Zen 4), and the
 * product of two bf16 values is exact in float32. Here each pair is two FMAs in that order, whose single
 * rounding is then that addition's, and every other step (group scales, the int4 offset, the split rows'
 * sum, bias, residual) is the AVX-512 kernel's operation in its order: each result is that kernel's bit for
 * bit, except where VDPBF16PS, which ignores MXCSR, flushes a denormal input, product or partial sum to zero
 * and an FMA does not (and bf16 outputs of a denormal). tests/workers/test_avx2_build.py compares the two.
 *
 * A bf16 value is the top half of a float32, so weights and inputs widen to float32 with a shift (the pair's
 * even column, its low half) or a mask (the odd column); int8 widens through a float conversion; int4 q
 * becomes 128 + q by OR-ing the nibble under the bits of 128.0f, as the AVX-512 kernel does in bf16.
 * Registers: a 16-row tile is two ymm vectors, so ROW_BLOCK 4 rows' accumulators (8), one widened pair (4)
 * and a row's two broadcast inputs fit AVX2's 16; the int8 / int4 totals, touched once a group, spill to L1.
 */
#include "internal.h"

#include <stdint.h>

#if TILED_KERNEL == 1

#define TILE QUANT_TILE
enum { ROW_BLOCK = 4 };

/* A pair of columns of a tile's 16 rows as float32: [0] rows 0..7, [1] rows 8..15. */
typedef struct {
    __m256 even[2], odd[2];
} Pair;

/* The bf16 number in the top (high_half) or bottom (low_half) 16 bits of each lane, as float32. */
static inline __m256 high_half(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline __m256 low_half(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }

static inline Pair widen_bf16(const uint16_t *pair) {
    Pair w;
    for (int h = 0; h < 2; h++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(pair + h * TILE));
        w.even[h] = low_half(v), w.odd[h] = high_half(v);
    }
    return w;
}

static inline __m256 int8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline Pair widen_int8(const int8_t *pair) {
    Pair w = {{int8x8(pair), int8x8(pair + 8)}, {int8x8(pair + TILE), int8x8(pair + TILE + 8)}};
    return w;
}

static inline Pair widen_int4(const uint8_t *pair) {
    const __m256i nibble = _mm256_set1_epi32(0xF), bits128 = _mm256_set1_epi32(0x43000000);
    Pair w;
    for (int h = 0; h < 2; h++) {
        __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(pair + h * 8)));
        __m256i even = _mm256_slli_epi32(_mm256_and_si256(bytes, nibble), 16);
        __m256i odd = _mm256_slli_epi32(_mm256_srli_epi32(bytes, 4), 16);
        w.even[h] = _mm256_castsi256_ps(_mm256_or_si256(even, bits128));
        w.odd[h] = _mm256_castsi256_ps(_mm256_or_si256(odd, bits128));
    }
    return w;
}

/* acc (+)= x . w for one pair: the odd column's product first, as VDPBF16PS adds them. */
static inline void pair_fma(const Pair *w, uint32_t x_pair, __m256 acc[2]) {
    __m256i x = _mm256_set1_epi32((int)x_pair);
    __m256 even = low_half(x), odd = high_half(x);
    for (int h = 0; h < 2; h++) {
        acc[h] = _mm256_fmadd_ps(odd, w->odd[h], acc[h]);
        acc[h] = _mm256_fmadd_ps(even, w->even[h], acc[h]);
    }
}

/* quant_kernels.c's tile_rows with two ymm per row: the same sums in the same order. */
static inline __attribute__((always_inline)) void tile_rows(
        int64_t kind, TileAt at, const uint16_t *rows, const float *sums, int64_t first, const int count,
        int64_t k_padded, int64_t group, __m256 total[][2]) {
    const int64_t groups = k_padded / group, pairs_per_group = group / 2, stride = k_padded / 2;
    const uint32_t *x = (const uint32_t *)rows + first * stride;
    for (int i = 0; i < count; i++) total[i][0] = total[i][1] = _mm256_setzero_ps();
    if (kind == TILED_BF16) {
        for (int64_t p = 0; p < stride; p++) {
            const Pair w = widen_bf16((const uint16_t *)at.values + p * 2 * TILE);
            for (int i = 0; i < count; i++) pair_fma(&w, x[i * stride + p], total[i]);
        }
        return;
    }
    const int is_int4 = kind == TILED_INT4;
    for (int64_t g = 0; g < groups; g++) {
        __m256 acc[ROW_BLOCK][2];
        for (int i = 0; i < count; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        for (int64_t p = g * pairs_per_group; p < (g + 1) * pairs_per_group; p++) {
            const Pair w = is_int4 ? widen_int4((const uint8_t *)at.values + p * TILE)
                                   : widen_int8((const int8_t *)at.values + p * 2 * TILE);
            for (int i = 0; i < count; i++) pair_fma(&w, x[i * stride + p], acc[i]);
        }
        for (int h = 0; h < 2; h++) {
            const __m256 scale = _mm256_loadu_ps(at.scale + g * TILE + h * 8);
            if (is_int4) {
                const __m256 low = _mm256_loadu_ps(at.low + g * TILE + h * 8);
                for (int i = 0; i < count; i++) {
                    float sum = sums[(first + i) * groups + g];
                    __m256 dot = _mm256_sub_ps(acc[i][h], _mm256_set1_ps(128.0f * sum)); /* x . q */
                    total[i][h] = _mm256_fmadd_ps(scale, dot, total[i][h]);
                    total[i][h] = _mm256_fmadd_ps(low, _mm256_set1_ps(sum), total[i][h]);
                }
            } else {
                for (int i = 0; i < count; i++) total[i][h] = _mm256_fmadd_ps(scale, acc[i][h], total[i][h]);
            }
        }
    }
}

/* Row `row` of y, columns column..column+15 (fewer at the edge): v (+ bias), added to y's values with
 * `accumulate`; the AVX-512 kernel's store_row, lane by lane where the tile is cut. */
static inline void store_row(void *y, int y_is_f32, int64_t y_stride, int accumulate, int64_t row, int64_t n,
                             int64_t column, const __m256 v[2], const float *bias) {
    if (y_is_f32 && n - column >= TILE) {
        float *at = (float *)y + row * y_stride + column;
        for (int h = 0; h < 2; h++) {
            __m256 out = bias != NULL ? _mm256_add_ps(v[h], _mm256_loadu_ps(bias + column + h * 8)) : v[h];
            if (accumulate) out = _mm256_add_ps(_mm256_loadu_ps(at + h * 8), out);
            _mm256_storeu_ps(at + h * 8, out);
        }
        return;
    }
    float lanes[TILE];
    _mm256_storeu_ps(lanes, v[0]), _mm256_storeu_ps(lanes + 8, v[1]);
    const int64_t width = n - column < TILE ? n - column : TILE;
    for (int64_t j = 0; j < width; j++) {
        float out = bias != NULL ? lanes[j] + bias[column + j] : lanes[j];
        if (y_is_f32) {
            float *at = (float *)y + row * y_stride + column + j;
            *at = accumulate ? *at + out : out;
        } else {
            ((uint16_t *)y)[row * y_stride + column + j] = f32_to_bf16(out);
        }
    }
}

/* internal.h: tile `t` of `w` against every prepared row. */
void tile_product(const Tiled *w, int64_t t, const uint16_t *rows, const float *sums, int64_t prepared,
                  int64_t per_input, int64_t n, const float *bias, void *y, int y_is_f32, int64_t y_stride,
                  int accumulate) {
    const TileAt at = tile_at(w, t);
    for (int64_t first = 0; first < prepared; first += ROW_BLOCK) {
        __m256 total[ROW_BLOCK][2];
        int64_t count = prepared - first < ROW_BLOCK ? prepared - first : ROW_BLOCK;
        /* constant counts let the compiler keep the accumulators in registers */
        switch (count) {
#define ROWS_CASE(c) case c: tile_rows(w->kind, at, rows, sums, first, c, w->k_padded, w->group, total); break;
            ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
#undef ROWS_CASE
        }
        for (int64_t i = 0; i < count; i += per_input) {
            __m256 v[2];
            for (int h = 0; h < 2; h++)
                v[h] = per_input == 2 ? _mm256_add_ps(total[i][h], total[i + 1][h]) : total[i][h];
            store_row(y, y_is_f32, y_stride, accumulate, (first + i) / per_input, n, t * TILE, v, bias);
        }
    }
}

#endif
