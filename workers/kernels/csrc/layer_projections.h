/* The fused decode layer's projections (decode_layer.c includes this once; it is that file's, split out by
 * role): the GEMV of float32, bfloat16-copy and int8 rows for a pass of up to MAX_ROWS rows, every row summed
 * in the same chains whatever the pass's size (batch invariance, design notes), and the tiled products of
 * quant_kernels.c; ``project_rows`` picks a projection's form. Called inside the step's parallel region. */
#ifndef LLMBUS_LAYER_PROJECTIONS_H
#define LLMBUS_LAYER_PROJECTIONS_H

#include "internal.h"

#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* bfloat16 values as the float32 numbers they are: the 16 bits above 16 zero bits. */
#if defined(__AVX512F__)
static inline __m512 widen_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 widen_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

/* y[b] = w . x[b] for the rows of the batch, w one weight row of n floats: float32 ones (w), or bfloat16
 * ones (wb, when w is null; called with a constant null or not, so each form compiles to its own loop).
 * Both read the same numbers and sum them in the same order: the results are the same bits.
 * Batch invariance (issue #35 part 4): every row sums in the same chains and reduces them in the same order
 * whatever ``rows`` is, so a row's result does not depend on how many rows share the pass. AVX-512: two
 * chains a row (16 zmm accumulators for MAX_ROWS rows); AVX2: four chains a row (one would wait on the FMA
 * latency), two rows at a time to fit 16 ymm registers, the weight row read again from cache per pair. */
static inline __attribute__((always_inline)) void dot_rows_of(const float *w, const uint16_t *wb, const float *x,
                                                              int64_t x_stride, int64_t rows, int64_t n, float *y) {
#if defined(__AVX512F__)
#define LOADW(k) (w != 0 ? _mm512_loadu_ps(w + (k)) : widen_bf16x16(wb + (k)))
    __m512 acc[MAX_ROWS], acc2[MAX_ROWS];
    for (int64_t b = 0; b < rows; b++) acc[b] = acc2[b] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        __m512 wv = LOADW(k), wv2 = LOADW(k + 16);
        for (int64_t b = 0; b < rows; b++) {
            acc[b] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + b * x_stride + k), acc[b]);
            acc2[b] = _mm512_fmadd_ps(wv2, _mm512_loadu_ps(x + b * x_stride + k + 16), acc2[b]);
        }
    }
    for (; k + 16 <= n; k += 16) {
        __m512 wv = LOADW(k);
        for (int64_t b = 0; b < rows; b++)
            acc[b] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + b * x_stride + k), acc[b]);
    }
    if (k < n) {
        __mmask16 tail = (__mmask16)((1u << (n - k)) - 1u);
        uint16_t tail_bits[16] = {0};
        if (w == 0) memcpy(tail_bits, wb + k, (size_t)(n - k) * sizeof *wb);
        __m512 wv = w != 0 ? _mm512_maskz_loadu_ps(tail, w + k) : widen_bf16x16(tail_bits);
        for (int64_t b = 0; b < rows; b++)
            acc[b] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(tail, x + b * x_stride + k), acc[b]);
    }
    for (int64_t b = 0; b < rows; b++) y[b] = _mm512_reduce_add_ps(_mm512_add_ps(acc[b], acc2[b]));
#undef LOADW
#elif defined(__AVX2__) && defined(__FMA__)
#define LOADW(k) (w != 0 ? _mm256_loadu_ps(w + (k)) : widen_bf16x8(wb + (k)))
    for (int64_t b0 = 0; b0 < rows; b0 += 2) {
        const int64_t pair = rows - b0 < 2 ? rows - b0 : 2;
        const float *xs = x + b0 * x_stride;
        __m256 acc[2][4];
        for (int64_t b = 0; b < pair; b++)
            for (int c = 0; c < 4; c++) acc[b][c] = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 32 <= n; k += 32) {
            __m256 wv[4] = {LOADW(k), LOADW(k + 8), LOADW(k + 16), LOADW(k + 24)};
            for (int64_t b = 0; b < pair; b++)
                for (int c = 0; c < 4; c++)
                    acc[b][c] = _mm256_fmadd_ps(wv[c], _mm256_loadu_ps(xs + b * x_stride + k + 8 * c), acc[b][c]);
        }
        for (int64_t b = 0; b < pair; b++)
            acc[b][0] = _mm256_add_ps(_mm256_add_ps(acc[b][0], acc[b][1]), _mm256_add_ps(acc[b][2], acc[b][3]));
        for (; k + 8 <= n; k += 8) {
            __m256 wv = LOADW(k);
            for (int64_t b = 0; b < pair; b++)
                acc[b][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xs + b * x_stride + k), acc[b][0]);
        }
        for (int64_t b = 0; b < pair; b++) {
            float sum = hsum256(acc[b][0]);
            /* fmaf: both forms contract alike (the compiler fused one form's multiply-add and not the other's) */
            for (int64_t t = k; t < n; t++) sum = fmaf(w != 0 ? w[t] : bf16_to_f32(wb[t]), xs[b * x_stride + t], sum);
            y[b0 + b] = sum;
        }
    }
#undef LOADW
#else
    for (int64_t b = 0; b < rows; b++) {
        float sum = 0.0f;
#pragma omp simd reduction(+:sum)
        for (int64_t k = 0; k < n; k++) sum += (w != 0 ? w[k] : bf16_to_f32(wb[k])) * x[b * x_stride + k];
        y[b] = sum;
    }
#endif
}

static inline void dot_rows(const float *w, const float *x, int64_t x_stride, int64_t rows, int64_t n, float *y) {
    dot_rows_of(w, 0, x, x_stride, rows, n, y);
}

/* Bytes ahead of the row being read that a batch-1 int8 or bfloat16 row's dot product asks the cache for.
 * The hardware's prefetcher alone leaves these loops waiting on memory: the conversions make them too slow
 * per byte for it to run far enough ahead. A row at a time with this distance beat four rows at a time with
 * the next four prefetched, and twice the distance gained nothing (design notes, "The int8 batch-1 GEMV:
 * one row at a time, prefetched" and "A bfloat16 checkpoint in float32"). */
enum { ROW_PREFETCH_BYTES = 2304 };

/* Ask the cache for the ``bytes`` of a row ROW_PREFETCH_BYTES past ``row``. */
static inline void prefetch_row_ahead(const void *row, int64_t bytes) {
#if defined(__AVX2__) || defined(__AVX512F__)
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)row + ROW_PREFETCH_BYTES + b, _MM_HINT_T0);
#else
    (void)row, (void)bytes;
#endif
}

static inline void dot_rows_bf16(const uint16_t *w, const float *x, int64_t x_stride, int64_t rows, int64_t n,
                                 float *y) {
    if (rows == 1) prefetch_row_ahead(w, n * (int64_t)sizeof *w);
    dot_rows_of(0, w, x, x_stride, rows, n, y);
}

/* y[b] = w . x[b] for int8 row ``w`` with one scale per group of ``group`` inputs: the group's dot product
 * of the raw values, times its scale (the same sum as the dequantized row's, up to float32 rounding). */
static inline void dot_rows_int8(const int8_t *w, const float *scale, int64_t group, const float *x,
                                 int64_t x_stride, int64_t rows, int64_t n, float *y) {
    float total[MAX_ROWS] = {0};
#if defined(__AVX2__) && defined(__FMA__)
    __m256 sums[MAX_ROWS];
    for (int64_t b = 0; b < rows; b++) sums[b] = _mm256_setzero_ps();
#define INT8X8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#endif
    for (int64_t g0 = 0, gi = 0; g0 < n; g0 += group, gi++) {
        const int64_t end = g0 + group < n ? g0 + group : n;
        int64_t k = g0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 group_scale = _mm256_set1_ps(scale[gi]);
        { /* one chain a row, whatever the rows (batch invariance): groups dot_int8_row does not take */
            __m256 acc[MAX_ROWS];
            for (int64_t b = 0; b < rows; b++) acc[b] = _mm256_setzero_ps();
            for (; k + 8 <= end; k += 8) {
                __m256 wv = INT8X8(w + k);
                for (int64_t b = 0; b < rows; b++)
                    acc[b] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + b * x_stride + k), acc[b]);
            }
            for (int64_t b = 0; b < rows; b++) sums[b] = _mm256_fmadd_ps(acc[b], group_scale, sums[b]);
        }
#endif
        if (k < end) {
            for (int64_t b = 0; b < rows; b++) {
                float rest = 0.0f;
                for (int64_t t = k; t < end; t++) rest += (float)w[t] * x[b * x_stride + t];
                total[b] += rest * scale[gi];
            }
        }
    }
    for (int64_t b = 0; b < rows; b++) {
#if defined(__AVX2__) && defined(__FMA__)
        total[b] += hsum256(sums[b]);
#endif
        y[b] = total[b];
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* w . x for one int8 row (scales ``scale``, one per group of ``group`` inputs, a multiple of 16 that
 * divides n). Each group's two partial sums start afresh, so consecutive groups overlap in the core; only
 * the two scaled sums (even and odd groups) carry from one group to the next. */
static inline float dot_int8_row(const int8_t *w, const float *scale, int64_t group, const float *x, int64_t n) {
    prefetch_row_ahead(w, n);
    _mm_prefetch((const char *)(scale + ROW_PREFETCH_BYTES / group), _MM_HINT_T0);
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    for (int64_t g0 = 0, gi = 0; g0 < n; g0 += group, gi++) {
        __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
        for (int64_t k = g0; k < g0 + group; k += 16) {
            a = _mm256_fmadd_ps(INT8X8(w + k), _mm256_loadu_ps(x + k), a);
            b = _mm256_fmadd_ps(INT8X8(w + k + 8), _mm256_loadu_ps(x + k + 8), b);
        }
        if (gi & 1) odd = _mm256_fmadd_ps(_mm256_add_ps(a, b), _mm256_set1_ps(scale[gi]), odd);
        else even = _mm256_fmadd_ps(_mm256_add_ps(a, b), _mm256_set1_ps(scale[gi]), even);
    }
    return hsum256(_mm256_add_ps(even, odd));
}
#endif

/* The int8 group of Q8_0 and of --quantize int8 (quant.py's INT8_GROUP). The int8 loops are inlined with it
 * as a constant, so the loop over a group's inputs unrolls and the prefetch offset of the scales is no
 * division, which is faster than the group read at run time (design notes, "The int8 batch-1 GEMV").
 * Other groups take the same loops with the group a variable. */
enum { COMMON_GROUP = 32 };

/* Row ``o`` of projection ``p`` (``in`` inputs) against the batch: int8 rows whose groups split into whole
 * runs of 16 in dot_int8_row, row by row (the same sums whatever the batch). */
static inline void dot_proj(const Proj *p, int64_t o, int64_t in, const float *x, int64_t x_stride, int64_t rows,
                            float *y) {
    if (p->bf16 != 0) {
        dot_rows_bf16(p->bf16 + o * in, x, x_stride, rows, in, y);
    } else if (p->values == 0) {
        dot_rows(p->dense + o * in, x, x_stride, rows, in, y);
    } else {
        const int64_t groups = (in + p->group - 1) / p->group;
        const int8_t *values = p->values + o * in;
        const float *scale = p->scale + o * groups;
#if defined(__AVX2__) && defined(__FMA__)
        if (p->group % 16 == 0 && in % p->group == 0) { /* the batch-1 step's loop, for every row alike
                                                          * (batch invariance), the weight row from cache */
            for (int64_t b = 0; b < rows; b++)
                y[b] = p->group == COMMON_GROUP ? dot_int8_row(values, scale, COMMON_GROUP, x + b * x_stride, in)
                                                : dot_int8_row(values, scale, p->group, x + b * x_stride, in);
            return;
        }
#endif
        if (p->group == COMMON_GROUP) dot_rows_int8(values, scale, COMMON_GROUP, x, x_stride, rows, in, y);
        else dot_rows_int8(values, scale, p->group, x, x_stride, rows, in, y);
    }
}

/* out[b] (+)= W x[b] (+ bias) for the outputs this thread takes; called inside a parallel region. Any number
 * of rows: passes of up to MAX_ROWS rows, weight row ``o`` from memory for the first pass and from cache for
 * the next ones, each row by dot_proj's arithmetic, the same whatever the batch (issue #35 part 4). */
static inline void gemv(const Proj *weight, const float *bias, const float *x, int64_t in, int64_t out_features,
                        int64_t rows, float *y, int64_t y_stride, int accumulate) {
#pragma omp for schedule(guided)
    for (int64_t o = 0; o < out_features; o++) {
        const float add = bias != 0 ? bias[o] : 0.0f;
        for (int64_t b0 = 0; b0 < rows; b0 += MAX_ROWS) {
            const int64_t pass = rows - b0 < MAX_ROWS ? rows - b0 : MAX_ROWS;
            float dots[MAX_ROWS];
            dot_proj(weight, o, in, x + b0 * in, in, pass, dots);
            for (int64_t b = 0; b < pass; b++) {
                if (accumulate) y[(b0 + b) * y_stride + o] += dots[b] + add;
                else y[(b0 + b) * y_stride + o] = dots[b] + add;
            }
        }
    }
}

/* y (+)= W x (+ bias) for a tiled projection and any number of rows: the rows as bf16 pairs first, then the
 * tiles (16 outputs each) split across the threads. Called inside a parallel region; ends on a barrier. Out of
 * line: inlined into decode_layer.c's layer (with tiled_parts' loop), it made GCC compile every layer's
 * projections slower (a Q4_K_M prompt 25%). */
static __attribute__((noinline)) void tiled_gemv(const Tiled *w, const float *bias, const float *x, int64_t in,
                                                 int64_t out_features, int64_t rows, float *y, int64_t y_stride,
                                                 int accumulate, uint16_t *prepared, float *sums) {
    const int64_t tiles = (out_features + QUANT_TILE - 1) / QUANT_TILE;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < rows; b++)
        tiled_prepare_row(w, x + b * in, in, prepared + b * tiled_rows_per_input(w) * w->k_padded,
                          sums == 0 ? 0 : sums + b * tiled_sums_per_row(w));
#pragma omp for schedule(guided)
    for (int64_t t = 0; t < tiles; t++) tiled_product(w, t, prepared, sums, rows, out_features, bias, y, y_stride,
                                                      accumulate);
}

/* tiled_gemv for a tiled projection, part after part where it is stacked from parts of different forms (Proj's
 * next), each into its own outputs. */
static inline void tiled_parts(const Proj *p, const float *bias, const float *x, int64_t in, int64_t out_features,
                               int64_t rows, float *y, int64_t y_stride, int accumulate, uint16_t *prepared,
                               float *sums) {
    for (int64_t first = 0; p != 0; p = p->next) {
        const int64_t width = p->next != 0 ? p->rows : out_features - first;
        tiled_gemv(&p->tiled, bias == 0 ? 0 : bias + first, x, in, width, rows, y + first, y_stride, accumulate,
                   prepared, sums);
        first += width;
    }
}

/* A projection of ``rows`` rows, through its tiled form where it has one. */
static inline void project_rows(const StepArgs *s, const Proj *p, const float *bias, const float *x, int64_t in,
                                int64_t out_features, int64_t rows, float *y, int64_t y_stride, int accumulate) {
    if (p->tiled.values != 0)
        tiled_parts(p, bias, x, in, out_features, rows, y, y_stride, accumulate, s->prepared, s->prepared_sums);
    else
        gemv(p, bias, x, in, out_features, rows, y, y_stride, accumulate);
}

/* A projection of every row of the step. */
static inline void project(const StepArgs *s, const Proj *p, const float *bias, const float *x, int64_t in,
                           int64_t out_features, float *y, int64_t y_stride, int accumulate) {
    project_rows(s, p, bias, x, in, out_features, s->batch, y, y_stride, accumulate);
}

#endif
