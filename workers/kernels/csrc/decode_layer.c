/* One decoder layer of the Llama family for a decode step on CPU, as one call: RMSNorm, the fused QKV
 * projection, RoPE, the new K/V into the paged pool, paged attention, the output projection and the
 * residual, RMSNorm, the fused gate/up projection with SiLU, the down projection and the residual.
 *
 * Why: a decode step of a small model is dispatch-bound in eager torch (about 30 small ops a layer,
 * each a few microseconds of Python, dispatcher and allocation around little arithmetic). Here a layer
 * is one parallel region whose stages are separated by OpenMP barriers; the projections are GEMVs that
 * stream each weight row once for every row of the batch, which is what bounds a small batch's step.
 *
 * float32 activations: weights [out, in] row-major as checkpoints store them, or int8 rows with group
 * scales (--quantize int8 where no tiled kernel runs: a quarter of the bytes to stream), the residual
 * stream float32 (as the torch path keeps it), the pool in torch's layout. Arithmetic is the torch path's up to the order of
 * float32 sums. Its structures (Proj, LayerArgs, StepArgs) are llmbus_kernels.h's; it attends through
 * decode_attention.c's pairs and, past MAX_ROWS rows, multiplies through gemm.c (internal.h).
 */
#include "internal.h"

#include <math.h>
#include <omp.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* What a layer's stages read of the pool: this layer's K and V and its window's first keys. */
typedef struct {
    void *pool_key, *pool_value;
    const int64_t *starts;
} LayerPool;

static inline LayerPool layer_pool(const StepArgs *s, const LayerArgs *l, int64_t layer) {
    int64_t offset = layer * s->pool_layer_stride * (s->pool_f16 ? 2 : 4);
    LayerPool pool = {(char *)s->pool_key + offset, (char *)s->pool_value + offset, s->starts[l->window]};
    return pool;
}

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
#pragma omp for schedule(static)
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
 * tiles (16 outputs each) split across the threads. Called inside a parallel region; ends on a barrier. */
static inline void tiled_gemv(const Tiled *w, const float *bias, const float *x, int64_t in, int64_t out_features,
                              int64_t rows, float *y, int64_t y_stride, int accumulate, uint16_t *prepared,
                              float *sums) {
    const int64_t groups = w->k_padded / w->group, tiles = (out_features + QUANT_TILE - 1) / QUANT_TILE;
    const int64_t per_input = w->split ? 2 : 1; /* prepared rows per input row */
#pragma omp for schedule(static)
    for (int64_t b = 0; b < rows; b++)
        tiled_prepare_row(w, x + b * in, in, prepared + b * per_input * w->k_padded,
                          sums == 0 ? 0 : sums + b * per_input * groups);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) tiled_product(w, t, prepared, sums, rows, out_features, bias, y, y_stride,
                                                      accumulate);
}

/* A projection of ``rows`` rows, through its tiled form where it has one. */
static inline void project_rows(const StepArgs *s, const Proj *p, const float *bias, const float *x, int64_t in,
                                int64_t out_features, int64_t rows, float *y, int64_t y_stride, int accumulate) {
    if (p->tiled.values != 0)
        tiled_gemv(&p->tiled, bias, x, in, out_features, rows, y, y_stride, accumulate, s->prepared,
                   s->prepared_sums);
    else
        gemv(p, bias, x, in, out_features, rows, y, y_stride, accumulate);
}

/* A projection of every row of the step. */
static inline void project(const StepArgs *s, const Proj *p, const float *bias, const float *x, int64_t in,
                           int64_t out_features, float *y, int64_t y_stride, int accumulate) {
    project_rows(s, p, bias, x, in, out_features, s->batch, y, y_stride, accumulate);
}

static inline void rms_norm(const float *x, const float *weight, int64_t n, float eps, float *out) {
    float sum = 0.0f;
#pragma omp simd reduction(+:sum)
    for (int64_t k = 0; k < n; k++) sum += x[k] * x[k];
    float inverse = 1.0f / sqrtf(sum / (float)n + eps);
#pragma omp simd
    for (int64_t k = 0; k < n; k++) out[k] = weight[k] * (x[k] * inverse);
}

/* x * cos + rotate_half(x) * sin over one head, in place. */
static inline void rope(float *x, const float *cos, const float *sin, int64_t head_dim) {
    int64_t half = head_dim / 2;
    float rotated[head_dim];
    for (int64_t d = 0; d < half; d++) {
        rotated[d] = x[d] * cos[d] + x[d + half] * sin[d];
        rotated[d + half] = x[d + half] * cos[d + half] + x[d] * sin[d + half];
    }
    memcpy(x, rotated, sizeof rotated);
}

static inline void attend_pair(const StepArgs *s, const LayerPool *l, int64_t pair, int64_t head_elems,
                               int64_t qkv_width, int64_t group) {
    const int64_t B = s->batch, D = s->head_dim, Hq = s->num_heads;
    int64_t kv_head = pair / B, b = pair % B;
    const float *query = s->qkv_out + b * qkv_width + kv_head * group * D;
    const int64_t *table = s->tables + b * s->table_stride;
    float *scores = s->scores + omp_get_thread_num() * group * s->scores_stride, *out = s->attended + (b * Hq + kv_head * group) * D;
    if (s->pool_f16)
        pair_f16kv(query, (const uint16_t *)l->pool_key + kv_head * head_elems,
                   (const uint16_t *)l->pool_value + kv_head * head_elems, table, s->block_size, l->starts[b],
                   s->lens[b], D, group, s->scale, scores, s->scores_stride, out);
    else
        pair_f32(query, (const float *)l->pool_key + kv_head * head_elems,
                 (const float *)l->pool_value + kv_head * head_elems, table, s->block_size, l->starts[b], s->lens[b],
                 D, group, s->scale, scores, s->scores_stride, out);
}

/* RoPE on the step's queries and keys, the new K/V into the pool, and attention, for every (kv head, row)
 * pair; called inside the layer's parallel region. */
static inline void rope_write_attend(const StepArgs *s, const LayerPool *l, const LayerArgs *w) {
    const int64_t B = s->batch, D = s->head_dim, Hq = s->num_heads, Hkv = s->num_kv_heads, group = Hq / Hkv;
    const int64_t qkv_width = (Hq + 2 * Hkv) * D, head_elems = s->pool_blocks * s->block_size * D;
#pragma omp for schedule(static)
    for (int64_t pair = 0; pair < Hkv * B; pair++) {
        int64_t kv_head = pair / B, b = pair % B;
        float *row = s->qkv_out + b * qkv_width;
        const float *cos = s->cos + b * D, *sin = s->sin + b * D;
        float *query = row + kv_head * group * D, *key = row + (Hq + kv_head) * D;
        if (w->q_norm) /* QK-norm (Qwen3): each head normalised over head_dim before its rotation */
            for (int64_t g = 0; g < group; g++) rms_norm(query + g * D, w->q_norm, D, s->eps, query + g * D);
        if (w->k_norm) rms_norm(key, w->k_norm, D, s->eps, key);
        for (int64_t g = 0; g < group; g++) rope(query + g * D, cos, sin, D);
        rope(key, cos, sin, D);
        const float *value = row + (Hq + Hkv + kv_head) * D;
        if (s->pool_f16)
            write_f16kv(key, value, (uint16_t *)l->pool_key + kv_head * head_elems,
                        (uint16_t *)l->pool_value + kv_head * head_elems, s->slots[b], s->block_size, D);
        else
            write_f32(key, value, (float *)l->pool_key + kv_head * head_elems,
                      (float *)l->pool_value + kv_head * head_elems, s->slots[b], s->block_size, D);
        if (!s->rows_share_sequences) attend_pair(s, l, pair, head_elems, qkv_width, group);
    }
    /* rows that are positions of one sequence (speculation) each attend to the ones before it: every
     * row's K/V is in the pool first (a barrier that one-row-per-sequence steps do without) */
    if (s->rows_share_sequences) {
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < Hkv * B; pair++) attend_pair(s, l, pair, head_elems, qkv_width, group);
    }
}

/* SiLU(gate) * up, with the sigmoid from exp of a non-positive argument on either side of zero. */
#pragma omp declare simd
static inline float silu_times(float gate, float up) {
    const float e = exp_nonpositive(gate < 0.0f ? gate : -gate);
    return gate * (gate < 0.0f ? e : 1.0f) / (1.0f + e) * up;
}

/* act = SiLU(gate) * up for every row of gate_up_out; called inside the step's parallel region. */
static inline void silu_rows(const StepArgs *s) {
    const int64_t I = s->intermediate;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < s->batch; b++) {
        const float *gate = s->gate_up_out + b * 2 * I, *up = gate + I;
        float *act = s->act + b * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) act[i] = silu_times(gate[i], up[i]);
    }
}

/* probs: a row's router logits in, its softmax out; then its top_k experts, most probable first (the lower
 * index on a tie) and their probabilities, rescaled to sum to one where the model asks: moe.py's route. */
static inline void route_row(const Experts *e, float *probs, int64_t *chosen, float *weights) {
    const int64_t E = e->num_experts;
    float maximum = probs[0], sum = 0.0f, total = 0.0f;
    for (int64_t x = 1; x < E; x++) maximum = probs[x] > maximum ? probs[x] : maximum;
    for (int64_t x = 0; x < E; x++) sum += probs[x] = expf(probs[x] - maximum);
    for (int64_t x = 0; x < E; x++) probs[x] /= sum;
    for (int64_t k = 0; k < e->top_k; k++) {
        int64_t best = -1;
        for (int64_t x = 0; x < E; x++) {
            int taken = 0;
            for (int64_t j = 0; j < k; j++) taken |= chosen[j] == x;
            if (!taken && (best < 0 || probs[x] > probs[best])) best = x;
        }
        chosen[k] = best;
        total += weights[k] = probs[best];
    }
    if (e->renormalize)
        for (int64_t k = 0; k < e->top_k; k++) weights[k] /= total;
}

/* hidden += the routed experts' MLP of the normed rows: each row routed, the rows grouped by expert (in row
 * order), each expert that has rows computing them together through the same projections as a dense MLP,
 * and each row's weighted outputs summed in expert order, as moe.py's torch block does. A row's result does
 * not depend on the rows beside it (each projection's per-row arithmetic does not). Called by every thread
 * of the step's parallel region; ends on a barrier. */
static void routed_experts(const StepArgs *s, const Experts *e, float *hidden) {
    const int64_t B = s->batch, H = s->hidden, E = e->num_experts, K = e->top_k, I = e->intermediate;
    int64_t *chosen = s->expert_rows, *order = chosen + B * K, *starts = order + B * K;
    float *row_weights = s->expert_weights, *sorted_weights = row_weights + B * K;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; b++) {
        float *probs = s->expert_probs + b * E;
        for (int64_t x = 0; x < E; x++) dot_rows(e->router + x * H, s->normed + b * H, H, 1, H, probs + x);
        route_row(e, probs, chosen + b * K, row_weights + b * K);
        memset(s->expert_sum + b * H, 0, (size_t)H * sizeof(float));
    }
#pragma omp single
    { /* a stable sort of the (row, choice) pairs by expert */
        int64_t next[E];
        memset(starts, 0, (size_t)(E + 1) * sizeof *starts);
        for (int64_t i = 0; i < B * K; i++) starts[chosen[i] + 1]++;
        for (int64_t x = 0; x < E; x++) starts[x + 1] += starts[x];
        for (int64_t x = 0; x < E; x++) next[x] = starts[x];
        for (int64_t i = 0; i < B * K; i++) {
            const int64_t at = next[chosen[i]]++;
            order[at] = i / K;
            sorted_weights[at] = row_weights[i];
        }
    }
    for (int64_t x = 0; x < E; x++) {
        const int64_t first = starts[x], count = starts[x + 1] - first;
        if (count == 0) continue; /* every thread skips alike: they all read the same starts */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++)
            memcpy(s->expert_in + i * H, s->normed + order[first + i] * H, (size_t)H * sizeof(float));
        project_rows(s, &e->gate_ups[x], 0, s->expert_in, H, 2 * I, count, s->gate_up_out, 2 * I, 0);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++) {
            const float *gate = s->gate_up_out + i * 2 * I, *up = gate + I;
            float *act = s->act + i * I;
#pragma omp simd
            for (int64_t j = 0; j < I; j++) act[j] = silu_times(gate[j], up[j]);
        }
        project_rows(s, &e->downs[x], 0, s->act, I, H, count, s->expert_out, H, 0);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++) { /* a row has each expert once: no two threads add to one row */
            const float weight = sorted_weights[first + i], *out = s->expert_out + i * H;
            float *sum = s->expert_sum + order[first + i] * H;
            for (int64_t h = 0; h < H; h++) sum[h] += out[h] * weight;
        }
    }
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) hidden[b * H + h] += s->expert_sum[b * H + h];
}

#if GEMM_RUNS
/* A batch past MAX_ROWS, float32 weights: the same stages, the projections as gemm.c's GEMMs (each weight
 * row used for every row of the batch from cache, not streamed per row as a GEMV would). Called by every
 * thread of the step's parallel region; ends on a barrier. */
static void layer_gemm(const StepArgs *s, const LayerArgs *l, const LayerPool *pool, float *hidden) {
    const int64_t B = s->batch, H = s->hidden, I = s->intermediate, D = s->head_dim, Hq = s->num_heads;
    const int64_t qkv_width = (Hq + 2 * s->num_kv_heads) * D;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; b++) rms_norm(hidden + b * H, l->input_norm, H, s->eps, s->normed + b * H);
    gemm_team(s->normed, l->qkv.dense, l->qkv_bias, B, qkv_width, H, s->qkv_out, qkv_width, 0, s->panels);
    rope_write_attend(s, pool, l);
    gemm_team(s->attended, l->o_proj.dense, l->o_bias, B, H, Hq * D, hidden, H, 1, s->panels);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; b++) rms_norm(hidden + b * H, l->post_norm, H, s->eps, s->normed + b * H);
    gemm_team(s->normed, l->gate_up.dense, l->gate_up_bias, B, 2 * I, H, s->gate_up_out, 2 * I, 0, s->panels);
    silu_rows(s);
    gemm_team(s->act, l->down.dense, l->down_bias, B, H, I, hidden, H, 1, s->panels);
}
#endif

/* Whether this build's GEMVs read bfloat16 copies (Proj.bf16) with SIMD: worth making them. */
int decode_layer_reads_bf16(void) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    return 1;
#else
    return 0;
#endif
}


/* The floats of StepArgs.panels a batch of ``rows`` needs, ``widest`` the most inputs of a projection. */
int64_t decode_layer_panel_floats(int64_t rows, int64_t widest) {
#if GEMM_RUNS
    return gemm_panel_floats(rows, widest);
#else
    (void)rows, (void)widest;
    return 0;
#endif
}

/* A batch of any size: the projections as GEMVs, each weight row streamed once for every pass of MAX_ROWS
 * rows (tiled ones: once for every row). Called by every thread of the step's parallel region; ends on a
 * barrier. */
static void layer_gemv(const StepArgs *s, const LayerArgs *l, const LayerPool *pool, float *hidden) {
    const int64_t B = s->batch, H = s->hidden, I = s->intermediate, D = s->head_dim;
    const int64_t Hq = s->num_heads, Hkv = s->num_kv_heads, qkv_width = (Hq + 2 * Hkv) * D;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; b++) rms_norm(hidden + b * H, l->input_norm, H, s->eps, s->normed + b * H);
    project(s, &l->qkv, l->qkv_bias, s->normed, H, qkv_width, s->qkv_out, qkv_width, 0);
    rope_write_attend(s, pool, l);
    project(s, &l->o_proj, l->o_bias, s->attended, Hq * D, H, hidden, H, 1);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; b++) rms_norm(hidden + b * H, l->post_norm, H, s->eps, s->normed + b * H);
    if (l->experts != 0) {
        routed_experts(s, l->experts, hidden);
        return;
    }
    if (l->gate_up.tiled.values != 0) { /* every row the same arithmetic, whatever the batch */
        project(s, &l->gate_up, l->gate_up_bias, s->normed, H, 2 * I, s->gate_up_out, 2 * I, 0);
        silu_rows(s);
        project(s, &l->down, l->down_bias, s->act, I, H, hidden, H, 1);
        return;
    }
    /* gate row i and up row I + i together: SiLU(gate) * up needs no second pass */
#pragma omp for schedule(static)
    for (int64_t i = 0; i < I; i++) {
        for (int64_t b0 = 0; b0 < B; b0 += MAX_ROWS) { /* passes of MAX_ROWS rows, as gemv's */
            const int64_t pass = B - b0 < MAX_ROWS ? B - b0 : MAX_ROWS;
            float gate[MAX_ROWS], up[MAX_ROWS];
            dot_proj(&l->gate_up, i, H, s->normed + b0 * H, H, pass, gate);
            dot_proj(&l->gate_up, I + i, H, s->normed + b0 * H, H, pass, up);
            for (int64_t b = 0; b < pass; b++) {
                float g = gate[b] + (l->gate_up_bias != 0 ? l->gate_up_bias[i] : 0.0f);
                float u = up[b] + (l->gate_up_bias != 0 ? l->gate_up_bias[I + i] : 0.0f);
                s->act[(b0 + b) * I + i] = g / (1.0f + expf(-g)) * u;
            }
        }
    }
    project(s, &l->down, l->down_bias, s->act, I, H, hidden, H, 1);
}

static inline int all_tiled(const LayerArgs *l) {
    return l->qkv.tiled.values != 0 && l->o_proj.tiled.values != 0 && l->gate_up.tiled.values != 0 &&
           l->down.tiled.values != 0;
}

/* Every layer of ``layers`` over hidden [B, H] (float32, updated in place), in one parallel region: the
 * threads go from one layer to the next at a barrier, not through a fork and join per layer, with no
 * Python between layers. Returns 0, or -1 for a shape it cannot take (nothing done). */
int decode_layers_f32(const StepArgs *s, const LayerArgs *layers, int64_t num_layers, float *hidden) {
    const int64_t B = s->batch, Hq = s->num_heads, Hkv = s->num_kv_heads;
    if (Hq % Hkv != 0 || s->head_dim % 2 != 0) return -1;
    /* Any batch through the GEMVs, in passes of MAX_ROWS rows with each row's arithmetic the same whatever
     * the batch; but a batch past MAX_ROWS of float32 weights where gemm.c runs (AVX2 without AVX-512) through
     * its GEMMs, whose sums are not the GEMV's (design notes, "Batch-invariant numerics on CPU"). */
    int large = B > MAX_ROWS && GEMM_RUNS;
    for (int64_t i = 0; i < num_layers && large; i++) {
        const LayerArgs *l = &layers[i];
        if (all_tiled(l) || l->qkv.dense == 0 || l->o_proj.dense == 0 || l->gate_up.dense == 0 || l->down.dense == 0)
            large = 0;
    }
#pragma omp parallel num_threads(score_threads())
    for (int64_t i = 0; i < num_layers; i++) {
        const LayerPool pool = layer_pool(s, &layers[i], i);
#if GEMM_RUNS
        if (large) {
            layer_gemm(s, &layers[i], &pool, hidden);
            continue;
        }
#endif
        layer_gemv(s, &layers[i], &pool, hidden);
    }
    return 0;
}

/* logits [rows, out] = RMSNorm(x [rows, in]; norm, eps) W^T for one projection (float32 or int8 rows): the
 * final norm and the LM head of a small decode step (its largest matrix, streamed once for every row), in
 * one parallel region. ``normed``: scratch of rows * in floats. norm may be null (x is normed already). */
int lm_head_f32(const Proj *weight, const float *norm, float eps, const float *x, int64_t in, int64_t out_features,
                int64_t rows, float *normed, float *y, uint16_t *prepared, float *prepared_sums) {
    const int tiled = weight->tiled.values != 0;
#pragma omp parallel
    {
        if (norm != 0) {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < rows; b++) rms_norm(x + b * in, norm, in, eps, normed + b * in);
        }
        const float *input = norm != 0 ? normed : x;
        if (tiled)
            tiled_gemv(&weight->tiled, 0, input, in, out_features, rows, y, out_features, 0, prepared, prepared_sums);
        else
            gemv(weight, 0, input, in, out_features, rows, y, out_features, 0);
    }
    return 0;
}

/* y [rows, out] = x [rows, in] W^T for one projection (float32 or int8 rows, or tiled). */
int gemv_proj(const Proj *weight, const float *x, int64_t in, int64_t out_features, int64_t rows, float *y,
              uint16_t *prepared, float *prepared_sums) {
    return lm_head_f32(weight, 0, 0.0f, x, in, out_features, rows, 0, y, prepared, prepared_sums);
}
