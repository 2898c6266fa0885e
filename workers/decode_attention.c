/* Decode attention over the dense K/V mirror (see attention.py's _DecodeMirror), one call per layer.
 *
 * Every sequence of a decode step brings one query token. For each (kv head, sequence) pair this writes
 * the step's new K/V into the mirror (and into the paged pool when asked), then attends the pair's
 * query heads (its GQA group) over keys start..len-1, reading each K and V row once from memory.
 * torch's batched matmuls read the same rows as 2 x Hkv * B tiny GEMVs, which on CPU run far below
 * memory bandwidth; they, the float32 softmax and bias add between them, and the four index_copy_
 * writes of the new K/V were about a quarter of a batch-64 decode step.
 *
 * Layouts of one pair's context (``capacity`` positions; ``D`` the head dim):
 *   float32:  K and V [capacity][D], as torch keeps them.
 *   bfloat16: K as [capacity/16][D/2][16][2] (blocks of 16 keys, two dims of a key side by side) and
 *             V as [capacity/2][D][2] (two keys of a dim side by side): the operand layouts of
 *             AVX512-BF16's VDPBF16PS, which multiplies bf16 pairs into float32 lanes, so q.k for 16
 *             keys and p.V for 16 dims are one instruction per pair of terms with no conversions or
 *             horizontal sums, and both stream through memory in order.
 * Arithmetic: products of bf16 values are exact in float32 and accumulate in float32; scores,
 * softmax and the weighted sum stay float32 except that bf16 probabilities are rounded to bf16 before
 * multiplying V, as torch's CPU attention does for bf16 (and llmbus' torch path, whose bmm takes them
 * in the value dtype). The output is rounded once to the storage dtype.
 *
 * Built on first use by cpu_kernels.py with the C compiler and OpenMP; the threads are torch's own (both
 * link the libgomp torch loaded). Without AVX-512 the portable loops below do the same, slower.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

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
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

/* exp(x) for x <= 0 (scores minus their maximum): Cody-Waite range reduction and a degree-6
 * polynomial, about 1 ulp, written so that the compiler vectorises it (libm's expf would not be). */
#pragma omp declare simd
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

/* scores[start..len) <- softmax; returns nothing, the probabilities replace the scores. */
static inline void softmax_in_place(float *scores, int64_t start, int64_t len) {
    float maximum = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max:maximum)
    for (int64_t j = start; j < len; j++) maximum = scores[j] > maximum ? scores[j] : maximum;
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

/* Where element (position j, dim d) of a pair's context lives, per dtype (see the layouts above). */
#define F32_KEY(j, d, capacity, head_dim) ((j) * (head_dim) + (d))
#define F32_VALUE(j, d, capacity, head_dim) ((j) * (head_dim) + (d))
#define BF16_KEY(j, d, capacity, head_dim) ((((j) >> 4) * ((head_dim) >> 1) + ((d) >> 1)) * 32 + ((j) & 15) * 2 + ((d) & 1))
#define BF16_VALUE(j, d, capacity, head_dim) (((j) >> 1) * (head_dim) * 2 + (d) * 2 + ((j) & 1))
static inline float f32_identity(float value) { return value; }
static inline float f32_load(const float *p) { return *p; }
static inline float bf16_load(const uint16_t *p) { return bf16_to_f32(*p); }
static inline float bf16_prob(float value) { return bf16_to_f32(f32_to_bf16(value)); }

/* The new token's K/V into the mirror at position len - 1, and into the pool when it is given. */
#define DEFINE_WRITE(NAME, T, KEY_AT, VALUE_AT)                                                             \
static inline void NAME(const T *key_in, const T *value_in, T *keys, T *values, int64_t position,          \
                        int64_t capacity, int64_t head_dim, T *pool_key, T *pool_value, int64_t slot) {     \
    for (int64_t d = 0; d < head_dim; d++) {                                                                \
        keys[KEY_AT(position, d, capacity, head_dim)] = key_in[d];                                          \
        values[VALUE_AT(position, d, capacity, head_dim)] = value_in[d];                                    \
    }                                                                                                       \
    if (pool_key != 0) {                                                                                    \
        memcpy(pool_key + slot * head_dim, key_in, head_dim * sizeof(T));                                   \
        memcpy(pool_value + slot * head_dim, value_in, head_dim * sizeof(T));                               \
    }                                                                                                       \
}
DEFINE_WRITE(write_f32, float, F32_KEY, F32_VALUE)
DEFINE_WRITE(write_bf16, uint16_t, BF16_KEY, BF16_VALUE)

/* One (kv head, sequence) pair, portable: every query head of the group in turn. */
#define DEFINE_PORTABLE_PAIR(NAME, T, LOAD, KEY_AT, VALUE_AT, PROB, ROUND)                                  \
static void NAME(const T *query, const T *keys, const T *values, int64_t start, int64_t len,               \
                 int64_t capacity, int64_t head_dim, int64_t group, float scale, float *scores, T *out) {   \
    float acc[head_dim];                                                                                    \
    for (int64_t g = 0; g < group; g++) {                                                                   \
        const T *q = query + g * head_dim;                                                                  \
        for (int64_t j = start; j < len; j++) {                                                             \
            float dot = 0.0f;                                                                               \
            _Pragma("omp simd reduction(+:dot)")                                                            \
            for (int64_t d = 0; d < head_dim; d++)                                                          \
                dot += LOAD(q + d) * LOAD(keys + KEY_AT(j, d, capacity, head_dim));                         \
            scores[j] = dot * scale;                                                                        \
        }                                                                                                   \
        softmax_in_place(scores, start, len);                                                               \
        for (int64_t d = 0; d < head_dim; d++) acc[d] = 0.0f;                                               \
        for (int64_t j = start; j < len; j++) {                                                             \
            float p = PROB(scores[j]);                                                                      \
            _Pragma("omp simd")                                                                             \
            for (int64_t d = 0; d < head_dim; d++) acc[d] += p * LOAD(values + VALUE_AT(j, d, capacity, head_dim)); \
        }                                                                                                   \
        for (int64_t d = 0; d < head_dim; d++) out[g * head_dim + d] = ROUND(acc[d]);                       \
    }                                                                                                       \
}
DEFINE_PORTABLE_PAIR(portable_f32_pair, float, f32_load, F32_KEY, F32_VALUE, f32_identity, f32_identity)
static void portable_f32(const float *query, const float *keys, const float *values, int64_t start, int64_t len,
                         int64_t capacity, int64_t head_dim, int64_t group, float scale, float *scores, float *out,
                         int64_t last_pair) {
    (void)last_pair;
    portable_f32_pair(query, keys, values, start, len, capacity, head_dim, group, scale, scores, out);
}
DEFINE_PORTABLE_PAIR(portable_bf16, uint16_t, bf16_load, BF16_KEY, BF16_VALUE, bf16_prob, f32_to_bf16)

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
static inline void softmax_to_bf16(float *scores, int64_t start, int64_t len) {
    const int64_t first = start & ~(int64_t)15, end = (len + 15) & ~(int64_t)15;
    __m512 maxima = _mm512_set1_ps(-INFINITY), sums = _mm512_setzero_ps();
    for (int64_t j = first; j < end; j += 16)
        maxima = _mm512_mask_max_ps(maxima, block_mask(j, start, len), maxima, _mm512_loadu_ps(scores + j));
    __m512 maximum = _mm512_set1_ps(_mm512_reduce_max_ps(maxima));
    for (int64_t j = first; j < end; j += 16) {
        __m512 e = _mm512_maskz_mov_ps(block_mask(j, start, len),
                                       exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + j), maximum)));
        _mm512_storeu_ps(scores + j, e);
        sums = _mm512_add_ps(sums, e);
    }
    __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sums));
    for (int64_t j = first; j < end; j += 16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)scores + j),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(scores + j), inverse)));
}

/* bf16, head_dim 64 or 128. K: per block of 16 keys (one contiguous 2 or 4 kB run), q.k for the 16 keys
 * and every query head of the group, so K streams from memory once and is re-read from L1 per head. V:
 * per pair of keys (one contiguous run of 2 x D values), p.V for 16 dims at a time; each head's output
 * accumulators stay in registers over a block of 16 keys. */
#define DEFINE_FAST_PAIR(NAME, HEAD_DIM)                                                                    \
static void NAME(const uint16_t *query, const uint16_t *keys, const uint16_t *values, int64_t start,       \
                 int64_t len, int64_t capacity, int64_t group, float scale, float *scores, uint16_t *out,   \
                 const char *next_keys, const char *next_values) {                                          \
    enum { PAIRS = HEAD_DIM / 2, CHUNKS = HEAD_DIM / 16 };                                                  \
    const int64_t first = start & ~(int64_t)15, stride = capacity + 16;                                     \
    for (int64_t j = first; j < len; j += 16) {                                                             \
        const uint16_t *block = keys + j * HEAD_DIM;                                                        \
        /* The next pair's K and V for these 16 positions, while this block computes: the hardware       \
         * prefetcher stops at every 4 kB page, and a pair's context is many pages. */                     \
        for (int line = 0; line < HEAD_DIM / 2; line++) {                                                   \
            _mm_prefetch(next_keys + (j * HEAD_DIM + line * 32) * 2, _MM_HINT_T1);                          \
            _mm_prefetch(next_values + (j * HEAD_DIM + line * 32) * 2, _MM_HINT_T1);                        \
        }                                                                                                   \
        for (int64_t g = 0; g < group; g++) {                                                               \
            const uint32_t *q_pairs = (const uint32_t *)(query + g * HEAD_DIM);                             \
            /* four accumulators: one chain of dependent VDPBF16PS would wait on its latency */            \
            __m512 dot[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()}; \
            for (int p = 0; p < PAIRS; p += 4)                                                              \
                for (int u = 0; u < 4; u++)                                                                 \
                    dot[u] = _mm512_dpbf16_ps(dot[u],                                                       \
                                              (__m512bh)_mm512_loadu_si512((const void *)(block + (p + u) * 32)), \
                                              (__m512bh)_mm512_set1_epi32((int)q_pairs[p + u]));           \
            __m512 sum = _mm512_add_ps(_mm512_add_ps(dot[0], dot[1]), _mm512_add_ps(dot[2], dot[3]));      \
            _mm512_storeu_ps(scores + g * stride + j, _mm512_mul_ps(sum, _mm512_set1_ps(scale)));           \
        }                                                                                                   \
    }                                                                                                       \
    for (int64_t g = 0; g < group; g++) softmax_to_bf16(scores + g * stride, start, len);                  \
    float totals[group][HEAD_DIM];                                                                          \
    memset(totals, 0, sizeof totals);                                                                       \
    for (int64_t j0 = first; j0 < len; j0 += 16) {                                                          \
        for (int64_t g = 0; g < group; g++) {                                                               \
            const uint32_t *prob_pairs = (const uint32_t *)((const uint16_t *)(scores + g * stride) + j0);  \
            const uint16_t *v_pairs = values + (j0 >> 1) * HEAD_DIM * 2;                                    \
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

static void pair_bf16(const uint16_t *query, const uint16_t *keys, const uint16_t *values, int64_t start,
                      int64_t len, int64_t capacity, int64_t head_dim, int64_t group, float scale, float *scores,
                      uint16_t *out, int64_t last_pair) {
#if FAST_BF16
    /* the next pair's context follows this one's in the mirror (the last pair prefetches its own) */
    const char *next_keys = (const char *)(keys + (last_pair ? 0 : capacity * head_dim));
    const char *next_values = (const char *)(values + (last_pair ? 0 : capacity * head_dim));
    if (head_dim == 64)
        return fast_bf16_64(query, keys, values, start, len, capacity, group, scale, scores, out, next_keys, next_values);
    if (head_dim == 128)
        return fast_bf16_128(query, keys, values, start, len, capacity, group, scale, scores, out, next_keys, next_values);
#else
    (void)last_pair;
#endif
    portable_bf16(query, keys, values, start, len, capacity, head_dim, group, scale, scores, out);
}

/* query [B, Hq, D] and new K/V [B, Hkv, D] with row strides; mirror K/V [Hkv, B, <layout>]; pool K/V
 * [Hkv, pool_size, D] with pool_slots [B], or null; out [B, Hq, D]; lens/starts [B]; scratch float32
 * [Hkv * B, group, capacity + 16]. Returns 0, or -1 for a shape it cannot take. */
#define DEFINE_ENTRY(NAME, T, WRITE, PAIR)                                                                  \
int NAME(const T *query, int64_t query_stride, const T *new_key, int64_t key_stride, const T *new_value,   \
         int64_t value_stride, T *mirror_key, T *mirror_value, T *pool_key, T *pool_value,                 \
         const int64_t *pool_slots, int64_t pool_size, T *out, const int64_t *lens, const int64_t *starts,  \
         int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t capacity, int64_t head_dim,        \
         float scale, float *scratch) {                                                                     \
    if (num_heads % num_kv_heads != 0 || capacity % 16 != 0 || head_dim % 2 != 0) return -1;              \
    int64_t group = num_heads / num_kv_heads;                                                               \
    _Pragma("omp parallel for schedule(static)")                                                            \
    for (int64_t pair = 0; pair < num_kv_heads * batch; pair++) {                                           \
        int64_t kv_head = pair / batch, seq = pair % batch, len = lens[seq];                                \
        T *keys = mirror_key + pair * capacity * head_dim;                                                  \
        T *values = mirror_value + pair * capacity * head_dim;                                              \
        WRITE(new_key + seq * key_stride + kv_head * head_dim,                                              \
              new_value + seq * value_stride + kv_head * head_dim, keys, values, len - 1, capacity,         \
              head_dim, pool_key, pool_value, pool_key != 0 ? kv_head * pool_size + pool_slots[seq] : 0);   \
        PAIR(query + seq * query_stride + kv_head * group * head_dim, keys, values, starts[seq], len,       \
             capacity, head_dim, group, scale, scratch + pair * group * (capacity + 16),                            \
             out + (seq * num_heads + kv_head * group) * head_dim, pair + 1 == num_kv_heads * batch);       \
    }                                                                                                       \
    return 0;                                                                                               \
}
DEFINE_ENTRY(decode_attention_bf16, uint16_t, write_bf16, pair_bf16)
DEFINE_ENTRY(decode_attention_f32, float, write_f32, portable_f32)
