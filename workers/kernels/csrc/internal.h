/* What the library's translation units share among themselves and never export: the small hot helpers,
 * kept static inline here so that every caller still inlines them (exp, bfloat16 and float16 conversions,
 * the horizontal sum, the KV pool's layouts and their writers), and the functions one file defines for
 * another (decode_layer.c attends through decode_attention.c's pairs and multiplies through gemm.c). */
#ifndef LLMBUS_KERNELS_INTERNAL_H
#define LLMBUS_KERNELS_INTERNAL_H

#include "fast_exp.h"
#include "llmbus_kernels.h"

#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline uint16_t f32_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(bits >> 16);
}

/* float16 storage: the compiler's _Float16 conversions (one instruction each with F16C). */
static inline float f16_to_f32(uint16_t value) {
    _Float16 half;
    memcpy(&half, &value, sizeof half);
    return (float)half;
}

static inline uint16_t f32_to_f16(float value) {
    _Float16 half = (_Float16)value;
    uint16_t bits;
    memcpy(&bits, &half, sizeof bits);
    return bits;
}

#if defined(__AVX2__) && defined(__FMA__)
/* The sum of the 8 lanes. */
static inline float hsum256(__m256 v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}
#endif

/* Where element (position w within its block, dim d) of a KV block lives, per dtype (decode_attention.c's
 * header has the layouts); a block holds block_size positions, so it starts at block * block_size * head_dim. */
/* Attention's scores scratch holds SCORE_SLOTS pairs' [group, scores_stride] at most, one per thread (the
 * parallel regions that attend run on at most SCORE_SLOTS threads): its size does not grow with the step's
 * rows, so a step of any length attends through the kernel, each (row, head) by the same arithmetic. */
enum { SCORE_SLOTS = 256 };
static inline int score_threads(void) {
    return omp_get_max_threads() < SCORE_SLOTS ? omp_get_max_threads() : SCORE_SLOTS;
}

#define F32_KEY(w, d, head_dim) ((w) * (head_dim) + (d))
#define F32_VALUE(w, d, head_dim) ((w) * (head_dim) + (d))
#define BF16_KEY(w, d, head_dim) ((((w) >> 4) * ((head_dim) >> 1) + ((d) >> 1)) * 32 + ((w) & 15) * 2 + ((d) & 1))
#define BF16_VALUE(w, d, head_dim) (((w) >> 1) * (head_dim) * 2 + (d) * 2 + ((w) & 1))
static inline float f32_identity(float value) { return value; }
static inline uint16_t u16_identity(uint16_t value) { return value; }

/* One token's K/V (one kv head, activations of type A) into the pool of type P at ``slot`` (block *
 * block_size + position in it). */
#define DEFINE_WRITE(NAME, A, P, KEY_AT, VALUE_AT, STORE)                                                   \
static inline void NAME(const A *key_in, const A *value_in, P *keys, P *values, int64_t slot,              \
                        int64_t block_size, int64_t head_dim) {                                             \
    int64_t base = (slot / block_size) * block_size * head_dim, w = slot % block_size;                      \
    for (int64_t d = 0; d < head_dim; d++) {                                                                \
        keys[base + KEY_AT(w, d, head_dim)] = STORE(key_in[d]);                                             \
        values[base + VALUE_AT(w, d, head_dim)] = STORE(value_in[d]);                                       \
    }                                                                                                       \
}
DEFINE_WRITE(write_f32, float, float, F32_KEY, F32_VALUE, f32_identity)
DEFINE_WRITE(write_bf16, uint16_t, uint16_t, BF16_KEY, BF16_VALUE, u16_identity)
DEFINE_WRITE(write_f16kv, float, uint16_t, F32_KEY, F32_VALUE, f32_to_f16)

/* decode_attention.c: one (kv head, sequence) pair of float32 queries over a float32 pool, or a float16 one:
 * every query head of the GQA group over keys start..len-1 read through the sequence's block ``table``,
 * its scores soft-capped (softcap > 0) and its softmax with the group's sinks (non-null). */
void pair_f32(const float *query, const float *keys, const float *values, const int64_t *table, int64_t block_size,
              int64_t start, int64_t len, int64_t head_dim, int64_t group, float scale, float softcap,
              const float *sinks, float *scores, int64_t scores_stride, float *out);
void pair_f16kv(const float *query, const uint16_t *keys, const uint16_t *values, const int64_t *table,
                int64_t block_size, int64_t start, int64_t len, int64_t head_dim, int64_t group, float scale,
                float softcap, const float *sinks, float *scores, int64_t scores_stride, float *out);

/* quant_kernels.c, for the fused decode layer's tiled projections (both no-ops where no tiled kernel runs,
 * where none is made): one float32 input row of k as its bf16 hi and lo rows (k_padded apart) and, for int4,
 * their group sums; and tile t (16 outputs) of y (+)= x . w (+ bias) for `inputs` rows prepared so. */
void tiled_prepare_row(const Tiled *w, const float *x, int64_t k, uint16_t *out, float *sums);
void tiled_product(const Tiled *w, int64_t t, const uint16_t *rows, const float *sums, int64_t inputs, int64_t n,
                   const float *bias, float *y, int64_t y_stride, int accumulate);

/* integer_products.c, for the same: whether w computes there (MXFP4, and int8 and int4 with bf16-rounded inputs:
 * groups of whole blocks of ACTIVATION_BLOCK, or int8's of 16 in whole blocks), and
 * its halves of a product: a row quantized to 16-bit pairs (k_padded / 2 words) and its stats (2 k_padded /
 * ACTIVATION_BLOCK floats), and tile t against `inputs` such rows. */
int integer_tiled(const Tiled *w);
/* The whole product there, as quant_kernels.c's entry points hand over a w integer_tiled takes: kind TILED_MXFP4
 * (scale: e8m0 bytes, group 32), TILED_INT4 (scale and low: float32) or TILED_INT8 (scale: float32); pairs:
 * scratch of m * k_padded / 2 words; block_stats: of 2 * m * k_padded / ACTIVATION_BLOCK floats. */
int integer_matmul(const Tiled *w, const void *x, int x_is_f32, int64_t m, int64_t k, int64_t x_stride, int64_t n,
                   const float *bias, void *y, uint32_t *pairs, float *block_stats);
void integer_prepare_row(const Tiled *w, const float *x, int64_t k, uint32_t *pairs, float *stats);
void integer_product(const Tiled *w, int64_t t, const uint32_t *pairs, const float *stats, int64_t inputs, int64_t n,
                     const float *bias, float *y, int64_t y_stride, int accumulate);

/* Rows of k_padded bf16 values a prepared input row of w takes: two where split (hi and lo), else one (a bf16
 * row, or the integer products' k_padded / 2 pairs of 16-bit values). */
static inline int64_t tiled_rows_per_input(const Tiled *w) { return w->split && !integer_tiled(w) ? 2 : 1; }

/* Floats of sums a prepared row of w takes: int4's group sums per bf16 row (two where split), or the integer
 * products' stats. */
static inline int64_t tiled_sums_per_row(const Tiled *w) {
    return integer_tiled(w) ? 2 * (w->k_padded / ACTIVATION_BLOCK) : (w->split ? 2 : 1) * (w->k_padded / w->group);
}

/* Which tiled kernel this build has (tiled_kernel_isa): VDPBF16PS's in quant_kernels.c, else the same numbers
 * from FMAs in quant_kernels_avx2.c (also on AVX-512 CPUs without BF16), else none. Plain numbers, as the
 * preprocessor cannot read llmbus_kernels.h's TILED_ISA_* enum: 2 is TILED_ISA_AVX512_BF16, 1 TILED_ISA_AVX2. */
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TILED_KERNEL 2
#elif defined(__AVX2__) && defined(__FMA__)
#define TILED_KERNEL 1
#else
#define TILED_KERNEL 0
#endif

#if TILED_KERNEL
/* Where tile t of w (16 output rows; int8, int4 or bf16: MXFP4 multiplies in integer_products.c only) starts: its
 * values, and its group scales and lows where it has them. */
typedef struct {
    const void *values;
    const float *scale, *low;
} TileAt;

static inline TileAt tile_at(const Tiled *w, int64_t t) {
    const int64_t groups = w->k_padded / w->group;
    const int64_t bytes = w->kind == TILED_INT4 ? w->k_padded / 2 * QUANT_TILE
                        : w->kind == TILED_INT8 ? w->k_padded * QUANT_TILE : w->k_padded * QUANT_TILE * 2;
    TileAt at = {(const uint8_t *)w->values + t * bytes, w->kind == TILED_BF16 ? 0 : w->scale + t * groups * QUANT_TILE,
                 w->kind == TILED_INT4 ? w->low + t * groups * QUANT_TILE : 0};
    return at;
}

/* Tile t of w against `prepared` bf16 rows (per_input of them per row of y, whose results add): rows of y
 * (y_stride apart; float32, or bf16 when y_is_f32 is 0) get x . w (+ bias), or add it. Defined by the file of
 * this build's TILED_KERNEL. */
void tile_product(const Tiled *w, int64_t t, const uint16_t *rows, const float *sums, int64_t prepared,
                  int64_t per_input, int64_t n, const float *bias, void *y, int y_is_f32, int64_t y_stride,
                  int accumulate);
#endif

/* gemm.c's register-tiled GEMM is built for AVX2 + FMA without AVX-512 only (gemm.c says why). */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define GEMM_RUNS 1
/* Floats of panel buffer gemm_team needs for ``m`` rows of ``k`` inputs. */
int64_t gemm_panel_floats(int64_t m, int64_t k);
/* y (+)= x w^T (+ bias), each thread of the enclosing parallel region calling it (see gemm.c). */
void gemm_team(const float *x, const float *w, const float *bias, int64_t m, int64_t n, int64_t k, float *y,
               int64_t y_stride, int accumulate, float *panels);
#else
#define GEMM_RUNS 0
#endif

#endif
