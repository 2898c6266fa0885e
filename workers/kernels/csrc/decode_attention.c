/* Decode attention over the paged KV pool, read in place through each sequence's block table, one call
 * per layer (the CPU attention backend, workers/attention/cpu.py).
 *
 * Every sequence of a decode step brings one query token. For each (kv head, sequence) pair this writes
 * the step's new K/V into the pool (unless write_kv already did), then attends the pair's query heads (its
 * GQA group) over keys start..len-1, reading each K and V row once from memory, where it lies: no gather
 * into a padded batch, no copy kept between steps. torch's batched matmuls over a gathered [Hkv * B,
 * max_ctx, D] batch read the same rows as 2 x Hkv * B tiny GEMVs, far below memory bandwidth on CPU, and
 * the gather itself copies every sequence's context, padded to the longest, every step.
 *
 * Layouts of one block of ``block_size`` positions (``D`` the head dim):
 *   float32:  K and V [block_size][D], as torch keeps them.
 *   float16:  the same, in half the bytes (``--kv-cache-dtype float16`` for a float32 model): queries, new
 *             K/V and the output stay float32; K/V are rounded to float16 as they are written (to nearest
 *             even, as torch's ``.to(torch.float16)``) and widened as they are read, so the arithmetic is
 *             float32's over the rounded values.
 *   bfloat16: K as [block_size/16][D/2][16][2] (chunks of 16 keys, two dims of a key side by side) and
 *             V as [block_size/2][D][2] (two keys of a dim side by side): the operand layouts of
 *             AVX512-BF16's VDPBF16PS, which multiplies bf16 pairs into float32 lanes, so q.k for 16
 *             keys and p.V for 16 dims are one instruction per pair of terms with no conversions or
 *             horizontal sums, and both stream through memory in order. The backend keeps the bf16 pool
 *             in this layout (block_size a multiple of 16) and converts when torch reads it.
 * Arithmetic: products of bf16 values are exact in float32 and accumulate in float32; scores,
 * softmax and the weighted sum stay float32 except that bf16 probabilities are rounded to bf16 before
 * multiplying V, as torch's CPU attention does for bf16 (and llmbus' torch path, whose bmm takes them
 * in the value dtype). The output is rounded once to the storage dtype.
 *
 * Two per-layer shapings of the scores, as transformers' eager attention applies them: a soft cap (Gemma 2:
 * each scaled score s becomes softcap * tanh(s / softcap) before the softmax; 0 for none) and sinks (gpt-oss:
 * per query head a logit that joins the softmax's maximum and sum and carries no value; null for none).
 *
 * Built on first use by workers/kernels/build.py with the C compiler and OpenMP; the threads are torch's own
 * (both link the libgomp torch loaded). float32 with a head dim that is a multiple of 64 has an AVX2 path;
 * without AVX-512 (bf16) or AVX2 (float32) the portable loops below do the same, slower.
 */
#include "internal.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* scores[start..len) <- softcap * tanh(score / softcap), where softcap > 0. */
static inline void cap_scores(float *scores, int64_t start, int64_t len, float softcap) {
    if (softcap <= 0.0f) return;
    for (int64_t j = start; j < len; j++) scores[j] = tanhf(scores[j] / softcap) * softcap;
}

/* The sink logit of head g of a group whose first head's is sinks[0]; -inf (no term) without sinks. */
static inline float sink_of(const float *sinks, int64_t g) { return sinks ? sinks[g] : -INFINITY; }

/* scores[start..len) <- softmax, with ``sink`` (-inf: none) a term of the maximum and the sum that has no
 * score of its own; returns nothing, the probabilities replace the scores. */
static inline void softmax_in_place(float *scores, int64_t start, int64_t len, float sink) {
    float maximum = sink, sum = 0.0f;
#pragma omp simd reduction(max:maximum)
    for (int64_t j = start; j < len; j++) maximum = scores[j] > maximum ? scores[j] : maximum;
    if (sink > -INFINITY) sum = exp_nonpositive(sink - maximum);
#pragma omp simd reduction(+:sum)
    for (int64_t j = start; j < len; j++) {
        float e = exp_nonpositive(scores[j] - maximum);
        scores[j] = e;
        sum += e;
    }
    float inverse = 1.0f / sum;
#pragma omp simd
    for (int64_t j = start; j < len; j++) scores[j] *= inverse;
}

static inline float f32_load(const float *p) { return *p; }
static inline float bf16_load(const uint16_t *p) { return bf16_to_f32(*p); }
static inline float f16_load(const uint16_t *p) { return f16_to_f32(*p); }
static inline float bf16_prob(float value) { return bf16_to_f32(f32_to_bf16(value)); }

/* One (kv head, sequence) pair, portable: every query head of the group in turn, reading the
 * sequence's positions block by block (table[i] holds positions i * block_size ...) of this kv head's
 * blocks. Queries and output of type A, the pool of type P. */
#define DEFINE_PORTABLE_PAIR(NAME, A, P, LOAD_A, LOAD, KEY_AT, VALUE_AT, PROB, ROUND)                       \
static void NAME(const A *query, const P *keys, const P *values, const int64_t *table, int64_t block_size, \
                 int64_t start, int64_t len, int64_t head_dim, int64_t group, float scale, float softcap,  \
                 const float *sinks, float *scores, int64_t scores_stride, A *out) {                       \
    float acc[head_dim];                                                                                    \
    const int64_t block_elems = block_size * head_dim;                                                      \
    const int64_t first_block = start / block_size, last_block = (len - 1) / block_size;                   \
    for (int64_t g = 0; g < group; g++) {                                                                   \
        const A *q = query + g * head_dim;                                                                  \
        float *row = scores + g * scores_stride;                                                            \
        for (int64_t i = first_block; i <= last_block; i++) {                                               \
            const P *block = keys + table[i] * block_elems;                                                 \
            int64_t base = i * block_size;                                                                  \
            int64_t lo = start > base ? start - base : 0, hi = len - base < block_size ? len - base : block_size; \
            for (int64_t w = lo; w < hi; w++) {                                                             \
                float dot = 0.0f;                                                                           \
                _Pragma("omp simd reduction(+:dot)")                                                        \
                for (int64_t d = 0; d < head_dim; d++)                                                      \
                    dot += LOAD_A(q + d) * LOAD(block + KEY_AT(w, d, head_dim));                            \
                row[base + w] = dot * scale;                                                                \
            }                                                                                               \
        }                                                                                                   \
        cap_scores(row, start, len, softcap);                                                               \
        softmax_in_place(row, start, len, sink_of(sinks, g));                                               \
        for (int64_t d = 0; d < head_dim; d++) acc[d] = 0.0f;                                               \
        for (int64_t i = first_block; i <= last_block; i++) {                                               \
            const P *block = values + table[i] * block_elems;                                               \
            int64_t base = i * block_size;                                                                  \
            int64_t lo = start > base ? start - base : 0, hi = len - base < block_size ? len - base : block_size; \
            for (int64_t w = lo; w < hi; w++) {                                                             \
                float p = PROB(row[base + w]);                                                              \
                _Pragma("omp simd")                                                                         \
                for (int64_t d = 0; d < head_dim; d++) acc[d] += p * LOAD(block + VALUE_AT(w, d, head_dim)); \
            }                                                                                               \
        }                                                                                                   \
        for (int64_t d = 0; d < head_dim; d++) out[g * head_dim + d] = ROUND(acc[d]);                       \
    }                                                                                                       \
}
DEFINE_PORTABLE_PAIR(portable_f32, float, float, f32_load, f32_load, F32_KEY, F32_VALUE, f32_identity, f32_identity)
DEFINE_PORTABLE_PAIR(portable_f16kv, float, uint16_t, f32_load, f16_load, F32_KEY, F32_VALUE, f32_identity,
                     f32_identity)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* Lane j: the sum of the 8 lanes of sums[j]. */
static inline __m256 lane_sums8(const __m256 sums[8]) {
    __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(sums[0], sums[1]), _mm256_hadd_ps(sums[2], sums[3]));
    __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(sums[4], sums[5]), _mm256_hadd_ps(sums[6], sums[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* The cache lines of the ``bytes`` at ``p``: the next block of a sequence is usually on another page, where
 * the hardware prefetcher does not follow, so each block would otherwise start with misses. */
static inline void prefetch_bytes(const void *p, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch((const char *)p + offset, _MM_HINT_T0);
}

/* Element ``i`` of a pool of float32 or (``half``) float16 values: its address; 8 from there as float32. */
static inline const void *element_at(const void *pool, int64_t i, const int half) {
    return half ? (const void *)((const uint16_t *)pool + i) : (const void *)((const float *)pool + i);
}

static inline __m256 load8(const void *pool, int64_t i, const int half) {
#if defined(__F16C__)
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)pool + i)));
#endif
    return _mm256_loadu_ps((const float *)pool + i);
}

/* Dims a p.V pass holds in registers for each of its heads: 3 heads x 64 dims are 24 accumulators, which
 * AVX-512's 32 vector registers hold and AVX2's 16 do not. */
#if defined(__AVX512VL__)
#define VALUE_DIMS 64
#else
#define VALUE_DIMS 32
#endif

/* out[h] = sum over the visible positions w of probs[h][w] * V[w], for ``heads`` (1-3, a constant where it
 * is inlined) heads sharing the V rows, VALUE_DIMS dims at a time: each row is loaded once for every head.
 * Each (head, dim) sums its terms in position order, one FMA a term, as a pass per head would. */
static inline __attribute__((always_inline)) void weighted_values(
        const float *probs, int64_t probs_stride, const void *values, const int64_t *table, int64_t block_size,
        int64_t start, int64_t len, int64_t head_dim, float *out, const int half, const int heads) {
    const int64_t block_elems = block_size * head_dim;
    const int64_t first_block = start / block_size, last_block = (len - 1) / block_size;
    for (int64_t d0 = 0; d0 < head_dim; d0 += VALUE_DIMS) {
        __m256 acc[3][VALUE_DIMS / 8];
        for (int h = 0; h < heads; h++)
            for (int c = 0; c < VALUE_DIMS / 8; c++) acc[h][c] = _mm256_setzero_ps();
        for (int64_t i = first_block; i <= last_block; i++) {
            const int64_t block = table[i] * block_elems + d0;
            const int64_t base = i * block_size;
            const int64_t lo = start > base ? start - base : 0, hi = len - base < block_size ? len - base : block_size;
            if (d0 == 0 && i < last_block) prefetch_bytes(element_at(values, table[i + 1] * block_elems, half),
                                                          block_elems * (half ? 2 : 4));
            for (int64_t w = lo; w < hi; w++) {
                __m256 p[3];
                for (int h = 0; h < heads; h++) p[h] = _mm256_set1_ps(probs[h * probs_stride + base + w]);
                for (int c = 0; c < VALUE_DIMS / 8; c++) {
                    const __m256 v = load8(values, block + w * head_dim + 8 * c, half);
                    for (int h = 0; h < heads; h++) acc[h][c] = _mm256_fmadd_ps(p[h], v, acc[h][c]);
                }
            }
        }
        for (int h = 0; h < heads; h++)
            for (int c = 0; c < VALUE_DIMS / 8; c++) _mm256_storeu_ps(out + h * head_dim + d0 + 8 * c, acc[h][c]);
    }
}

/* float32 queries over a float32 pool, or (``half``) a float16 one widened as it is read (F16C), head_dim a
 * multiple of 64, AVX2: the portable pair's arithmetic with q.k for 8 keys at a time
 * (one horizontal reduction per 8 keys, not per key) and p.V into accumulators held in registers (the
 * portable loop loads and stores its accumulator array for every key), each V row read once for up to 3
 * heads of the group (once per head took 7-8% longer over SmolLM2's batch-64 attention:
 * ``benchmarks/decode_attention_ab.py --context 192 --tables served``). */
static inline __attribute__((always_inline)) void avx2_pair(
        const float *query, const void *keys, const void *values, const int64_t *table, int64_t block_size,
        int64_t start, int64_t len, int64_t head_dim, int64_t group, float scale, float softcap, const float *sinks,
        float *scores, int64_t scores_stride, float *out, const int half) {
    const int64_t block_elems = block_size * head_dim;
    const int64_t first_block = start / block_size, last_block = (len - 1) / block_size;
    /* q.k: every head of the group over each chunk of 8 keys while the chunk is in L1 */
    const int64_t block_bytes = block_elems * (half ? 2 : 4);
    for (int64_t i = first_block; i <= last_block; i++) {
        const int64_t block = table[i] * block_elems;
        const int64_t base = i * block_size;
        const int64_t lo = start > base ? start - base : 0, hi = len - base < block_size ? len - base : block_size;
        prefetch_bytes(i < last_block ? element_at(keys, table[i + 1] * block_elems, half)
                                      : element_at(values, table[first_block] * block_elems, half), block_bytes);
        int64_t w = lo;
        for (; w + 8 <= hi; w += 8) {
            for (int64_t g = 0; g < group; g++) {
                const float *q = query + g * head_dim;
                __m256 sums[8];
                for (int j = 0; j < 8; j++) sums[j] = _mm256_setzero_ps();
                for (int64_t d = 0; d < head_dim; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(q + d);
                    for (int j = 0; j < 8; j++)
                        sums[j] = _mm256_fmadd_ps(qv, load8(keys, block + (w + j) * head_dim + d, half), sums[j]);
                }
                _mm256_storeu_ps(scores + g * scores_stride + base + w,
                                 _mm256_mul_ps(lane_sums8(sums), _mm256_set1_ps(scale)));
            }
        }
        for (; w < hi; w++) {
            for (int64_t g = 0; g < group; g++) {
                const float *q = query + g * head_dim;
                __m256 sum = _mm256_setzero_ps();
                for (int64_t d = 0; d < head_dim; d += 8)
                    sum = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(keys, block + w * head_dim + d, half), sum);
                scores[g * scores_stride + base + w] = hsum256(sum) * scale;
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        cap_scores(scores + g * scores_stride, start, len, softcap);
        softmax_in_place(scores + g * scores_stride, start, len, sink_of(sinks, g));
    }
    /* p.V: up to 3 heads of the group at a time, each V row read once for all of them */
    int64_t g0 = 0;
    for (; g0 + 3 <= group; g0 += 3)
        weighted_values(scores + g0 * scores_stride, scores_stride, values, table, block_size, start, len, head_dim,
                        out + g0 * head_dim, half, 3);
    if (group - g0 == 2)
        weighted_values(scores + g0 * scores_stride, scores_stride, values, table, block_size, start, len, head_dim,
                        out + g0 * head_dim, half, 2);
    else if (group - g0 == 1)
        weighted_values(scores + g0 * scores_stride, scores_stride, values, table, block_size, start, len, head_dim,
                        out + g0 * head_dim, half, 1);
}

static void avx2_f32(const float *query, const float *keys, const float *values, const int64_t *table,
                     int64_t block_size, int64_t start, int64_t len, int64_t head_dim, int64_t group,
                     float scale, float softcap, const float *sinks, float *scores, int64_t scores_stride,
                     float *out) {
    avx2_pair(query, keys, values, table, block_size, start, len, head_dim, group, scale, softcap, sinks, scores,
              scores_stride, out, 0);
}

#if defined(__F16C__)
/* Each head of the group widens the K/V it reads itself: widening a chunk once into float32 rows in L1 for
 * all of them measured slower (design notes, "A float16 KV cache for float32 models"). */
static void avx2_f16kv(const float *query, const uint16_t *keys, const uint16_t *values, const int64_t *table,
                       int64_t block_size, int64_t start, int64_t len, int64_t head_dim, int64_t group,
                       float scale, float softcap, const float *sinks, float *scores, int64_t scores_stride,
                       float *out) {
    avx2_pair(query, keys, values, table, block_size, start, len, head_dim, group, scale, softcap, sinks, scores,
              scores_stride, out, 1);
}
#endif
#endif

/* One (kv head, sequence) pair in float32 (decode_layer.c attends through it too). */
void pair_f32(const float *query, const float *keys, const float *values, const int64_t *table,
                            int64_t block_size, int64_t start, int64_t len, int64_t head_dim, int64_t group,
                            float scale, float softcap, const float *sinks, float *scores, int64_t scores_stride,
                            float *out) {
#if defined(__AVX2__) && defined(__FMA__)
    if (head_dim % 64 == 0) {
        avx2_f32(query, keys, values, table, block_size, start, len, head_dim, group, scale, softcap, sinks, scores,
                 scores_stride, out);
        return;
    }
#endif
    portable_f32(query, keys, values, table, block_size, start, len, head_dim, group, scale, softcap, sinks, scores,
                 scores_stride, out);
}

/* One (kv head, sequence) pair of float32 queries over a float16 pool. */
void pair_f16kv(const float *query, const uint16_t *keys, const uint16_t *values, const int64_t *table,
                              int64_t block_size, int64_t start, int64_t len, int64_t head_dim, int64_t group,
                              float scale, float softcap, const float *sinks, float *scores,
                              int64_t scores_stride, float *out) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (head_dim % 64 == 0) {
        avx2_f16kv(query, keys, values, table, block_size, start, len, head_dim, group, scale, softcap, sinks,
                   scores, scores_stride, out);
        return;
    }
#endif
    portable_f16kv(query, keys, values, table, block_size, start, len, head_dim, group, scale, softcap, sinks,
                   scores, scores_stride, out);
}
DEFINE_PORTABLE_PAIR(portable_bf16, uint16_t, uint16_t, bf16_load, bf16_load, BF16_KEY, BF16_VALUE, bf16_prob,
                     f32_to_bf16)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define FAST_BF16 1

/* exp(x) for 16 lanes of x <= 0, as exp_nonpositive. */
static inline __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* Lanes of the 16-key block at j inside start..len-1. */
static inline __mmask16 block_mask(int64_t j, int64_t start, int64_t len) {
    int64_t lo = start > j ? start - j : 0, hi = len - j < 16 ? len - j : 16;
    return (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

/* The softmax of scores[start..len), then every 16-key block from start's to len's as bf16 probabilities,
 * zero outside start..len-1, written over the floats they come from (a block's 32 bytes land at or
 * before the 64 it was read from). */
static inline void softmax_to_bf16(float *scores, int64_t start, int64_t len, float sink) {
    const int64_t first = start & ~(int64_t)15, end = (len + 15) & ~(int64_t)15;
    __m512 maxima = _mm512_set1_ps(sink), sums = _mm512_setzero_ps();
    for (int64_t j = first; j < end; j += 16)
        maxima = _mm512_mask_max_ps(maxima, block_mask(j, start, len), maxima, _mm512_loadu_ps(scores + j));
    __m512 maximum = _mm512_set1_ps(_mm512_reduce_max_ps(maxima));
    for (int64_t j = first; j < end; j += 16) {
        __m512 e = _mm512_maskz_mov_ps(block_mask(j, start, len),
                                       exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + j), maximum)));
        _mm512_storeu_ps(scores + j, e);
        sums = _mm512_add_ps(sums, e);
    }
    float sink_term = sink > -INFINITY ? exp_nonpositive(sink - _mm512_cvtss_f32(maximum)) : 0.0f;
    __m512 inverse = _mm512_set1_ps(1.0f / (_mm512_reduce_add_ps(sums) + sink_term));
    for (int64_t j = first; j < end; j += 16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)scores + j),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(scores + j), inverse)));
}

/* bf16, head_dim 64 or 128. K: per chunk of 16 keys (one contiguous 2 or 4 kB run inside a block),
 * q.k for the 16 keys and every query head of the group, so K streams from memory once and is re-read
 * from L1 per head. V: per pair of keys (one contiguous run of 2 x D values), p.V for 16 dims at a
 * time; each head's output accumulators stay in registers over a chunk of 16 keys. block_size is a
 * multiple of 16, so a chunk never straddles two blocks. */
#define DEFINE_FAST_PAIR(NAME, HEAD_DIM)                                                                    \
static void NAME(const uint16_t *query, const uint16_t *keys, const uint16_t *values, const int64_t *table, \
                 int64_t block_size, int64_t start, int64_t len, int64_t group, float scale, float softcap, \
                 const float *sinks, float *scores, int64_t scores_stride, uint16_t *out) {                 \
    enum { PAIRS = HEAD_DIM / 2, CHUNKS = HEAD_DIM / 16 };                                                  \
    const int64_t first = start & ~(int64_t)15, block_elems = block_size * HEAD_DIM;                        \
    for (int64_t j = first; j < len; j += 16) {                                                             \
        const int64_t offset = table[j / block_size] * block_elems + (j % block_size) * HEAD_DIM;           \
        const uint16_t *chunk = keys + offset;                                                              \
        /* The next chunk's K and V while this one computes: blocks are scattered through the pool, so   \
         * the hardware prefetcher cannot follow from one to the next. */                                  \
        if (j + 16 < len) {                                                                                 \
            const int64_t next = table[(j + 16) / block_size] * block_elems + ((j + 16) % block_size) * HEAD_DIM; \
            for (int line = 0; line < HEAD_DIM / 2; line++) {                                               \
                _mm_prefetch((const char *)(keys + next + line * 32), _MM_HINT_T0);                         \
                _mm_prefetch((const char *)(values + next + line * 32), _MM_HINT_T0);                       \
            }                                                                                               \
        }                                                                                                   \
        for (int64_t g = 0; g < group; g++) {                                                               \
            const uint32_t *q_pairs = (const uint32_t *)(query + g * HEAD_DIM);                             \
            /* four accumulators: one chain of dependent VDPBF16PS would wait on its latency */            \
            __m512 dot[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()}; \
            for (int p = 0; p < PAIRS; p += 4)                                                              \
                for (int u = 0; u < 4; u++)                                                                 \
                    dot[u] = _mm512_dpbf16_ps(dot[u],                                                       \
                                              (__m512bh)_mm512_loadu_si512((const void *)(chunk + (p + u) * 32)), \
                                              (__m512bh)_mm512_set1_epi32((int)q_pairs[p + u]));           \
            __m512 sum = _mm512_add_ps(_mm512_add_ps(dot[0], dot[1]), _mm512_add_ps(dot[2], dot[3]));      \
            _mm512_storeu_ps(scores + g * scores_stride + j, _mm512_mul_ps(sum, _mm512_set1_ps(scale)));    \
        }                                                                                                   \
    }                                                                                                       \
    for (int64_t g = 0; g < group; g++) {                                                                   \
        cap_scores(scores + g * scores_stride, start, len, softcap);                                        \
        softmax_to_bf16(scores + g * scores_stride, start, len, sink_of(sinks, g));                         \
    }                                                                                                       \
    float totals[group][HEAD_DIM];                                                                          \
    memset(totals, 0, sizeof totals);                                                                       \
    for (int64_t j0 = first; j0 < len; j0 += 16) {                                                          \
        const uint16_t *chunk = values + table[j0 / block_size] * block_elems + (j0 % block_size) * HEAD_DIM; \
        for (int64_t g = 0; g < group; g++) {                                                               \
            const uint32_t *prob_pairs = (const uint32_t *)((const uint16_t *)(scores + g * scores_stride) + j0); \
            const uint16_t *v_pairs = chunk;                                                                \
            __m512 acc[CHUNKS];                                                                             \
            for (int c = 0; c < CHUNKS; c++) acc[c] = _mm512_loadu_ps(totals[g] + c * 16);                  \
            for (int k = 0; k < 8; k++, v_pairs += HEAD_DIM * 2) {                                          \
                __m512bh probs = (__m512bh)_mm512_set1_epi32((int)prob_pairs[k]);                           \
                for (int c = 0; c < CHUNKS; c++)                                                            \
                    acc[c] = _mm512_dpbf16_ps(acc[c], (__m512bh)_mm512_loadu_si512((const void *)(v_pairs + c * 32)), \
                                              probs);                                                       \
            }                                                                                               \
            for (int c = 0; c < CHUNKS; c++) _mm512_storeu_ps(totals[g] + c * 16, acc[c]);                  \
        }                                                                                                   \
    }                                                                                                       \
    for (int64_t g = 0; g < group; g++)                                                                     \
        for (int c = 0; c < CHUNKS; c++)                                                                    \
            _mm256_storeu_si256((__m256i *)(out + g * HEAD_DIM + c * 16),                                   \
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(totals[g] + c * 16)));          \
}
DEFINE_FAST_PAIR(fast_bf16_64, 64)
DEFINE_FAST_PAIR(fast_bf16_128, 128)
#else
#define FAST_BF16 0
#endif

static void pair_bf16(const uint16_t *query, const uint16_t *keys, const uint16_t *values, const int64_t *table,
                      int64_t block_size, int64_t start, int64_t len, int64_t head_dim, int64_t group, float scale,
                      float softcap, const float *sinks, float *scores, int64_t scores_stride, uint16_t *out) {
#if FAST_BF16
    if (head_dim == 64)
        return fast_bf16_64(query, keys, values, table, block_size, start, len, group, scale, softcap, sinks, scores,
                            scores_stride, out);
    if (head_dim == 128)
        return fast_bf16_128(query, keys, values, table, block_size, start, len, group, scale, softcap, sinks, scores,
                             scores_stride, out);
#endif
    portable_bf16(query, keys, values, table, block_size, start, len, head_dim, group, scale, softcap, sinks, scores,
                  scores_stride, out);
}

/* Arguments of both entries:
 *   query [B, Hq, D], new K/V [B, Hkv, D], each with its row stride (they may be views of a fused QKV);
 *   pool K/V: one layer's [Hkv, pool_blocks, block_size, D] in the dtype's layout;
 *   slots [B]: where each sequence's new K/V go (block * block_size + position), or null when the pool
 *   already holds them (written by write_kv beside other groups);
 *   tables [B, table_stride]: each sequence's blocks, in order; lens [B] its context with this token;
 *   starts [B] its first visible key (a sliding window); out [B, Hq, D];
 *   softcap: the layer's soft cap of the scaled scores, 0 for none; sinks [Hq] its sink logits, or null;
 *   scratch float32 [attention_threads(), group, scores_stride] (one slot a thread), scores_stride >=
 *   max(lens) rounded up to 16.
 * Returns 0, or -1 for a shape it cannot take. */
#define DEFINE_ENTRY(NAME, A, P, WRITE, PAIR, BLOCK_MULTIPLE)                                               \
LLMBUS_DECODE_ATTENTION(NAME, A, P) {                                                                      \
    if (num_heads % num_kv_heads != 0 || block_size % BLOCK_MULTIPLE != 0 || head_dim % 2 != 0) return -1; \
    int64_t group = num_heads / num_kv_heads, head_elems = pool_blocks * block_size * head_dim;            \
    /* every row's K/V first: rows may be positions of one sequence (speculation), each attending to the \
     * ones before it */                                                                                   \
    _Pragma("omp parallel num_threads(score_threads())")                                                   \
    {                                                                                                       \
        if (slots != 0) {                                                                                   \
            _Pragma("omp for schedule(static)")                                                             \
            for (int64_t pair = 0; pair < num_kv_heads * batch; pair++) {                                   \
                int64_t kv_head = pair / batch, seq = pair % batch;                                         \
                WRITE(new_key + seq * key_stride + kv_head * head_dim,                                      \
                      new_value + seq * value_stride + kv_head * head_dim, pool_key + kv_head * head_elems,  \
                      pool_value + kv_head * head_elems, slots[seq], block_size, head_dim);                 \
            }                                                                                               \
        }                                                                                                   \
        _Pragma("omp for schedule(static)")                                                                 \
        for (int64_t pair = 0; pair < num_kv_heads * batch; pair++) {                                       \
            int64_t kv_head = pair / batch, seq = pair % batch;                                             \
            PAIR(query + seq * query_stride + kv_head * group * head_dim, pool_key + kv_head * head_elems,  \
                 pool_value + kv_head * head_elems, tables + seq * table_stride, block_size, starts[seq],   \
                 lens[seq], head_dim, group, scale, softcap, sinks ? sinks + kv_head * group : 0,            \
                 scratch + omp_get_thread_num() * group * scores_stride, scores_stride,                      \
                 out + (seq * num_heads + kv_head * group) * head_dim);                                     \
        }                                                                                                   \
    }                                                                                                       \
    return 0;                                                                                               \
}
DEFINE_ENTRY(decode_attention_bf16, uint16_t, uint16_t, write_bf16, pair_bf16, 16)
DEFINE_ENTRY(decode_attention_f32, float, float, write_f32, pair_f32, 1)
DEFINE_ENTRY(decode_attention_f16kv, float, uint16_t, write_f16kv, pair_f16kv, 1)

/* How many slots attention's scores scratch must have: one a thread of the regions that attend (the pair
 * loops hand pairs to whichever thread is free, so a slot per pair would not do when pairs < threads). */
int64_t attention_threads(void) { return score_threads(); }

/* Tokens' K/V [T, Hkv, D] (row strides as above) into one layer's pool at slots [T]: how every token of
 * a step that is not only decodes reaches the pool in the kernel's layout. */
#define DEFINE_WRITE_ENTRY(NAME, A, P, WRITE)                                                               \
LLMBUS_WRITE_KV(NAME, A, P) {                                                                              \
    int64_t head_elems = pool_blocks * block_size * head_dim;                                               \
    for (int64_t t = 0; t < tokens; t++)                                                                    \
        for (int64_t h = 0; h < num_kv_heads; h++)                                                          \
            WRITE(new_key + t * key_stride + h * head_dim, new_value + t * value_stride + h * head_dim,     \
                  pool_key + h * head_elems, pool_value + h * head_elems, slots[t], block_size, head_dim);   \
}
DEFINE_WRITE_ENTRY(write_kv_bf16, uint16_t, uint16_t, write_bf16)
DEFINE_WRITE_ENTRY(write_kv_f32, float, float, write_f32)
DEFINE_WRITE_ENTRY(write_kv_f16kv, float, uint16_t, write_f16kv)
