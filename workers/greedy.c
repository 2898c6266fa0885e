/* Greedy decoding's choice and its log-probability for rows of float32 logits: the first index of each row's
 * largest logit, and that logit's log-softmax, -log(sum_j exp(x_j - max)), in one call for the whole batch.
 *
 * Why: torch does this as argmax, then log_softmax over the whole [rows, vocab] batch (written out in full
 * to read one entry of each row), then a gather: about 7 ms of a batch-64 SmolLM2 step (vocabulary 49152)
 * on 2 cores, where one read of the logits takes well under one. Here each row is read twice (its maximum,
 * then the sum of exponentials, the row still in L2), rows split across the threads, or a single row's
 * vocabulary split across them.
 *
 * Matches torch: ties go to the first index; a row with a NaN picks its first NaN and gets a NaN
 * log-probability, and a row with no finite maximum (all -inf, or a +inf) gets a NaN log-probability, as
 * log_softmax gives them. Sums are float32 in another order than torch's: log-probabilities agree to
 * float32 rounding, ids exactly. Built on first use by cpu_kernels.py, like the other kernels.
 */
#include "fast_exp.c"

#include <math.h>
#include <omp.h>
#include <stdint.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { MAX_THREADS = 256 };

typedef struct {
    float maximum;
    int64_t index; /* first index of the maximum in the span, or of its first NaN when has_nan */
    int has_nan;
} SpanMax;

static SpanMax span_max(const float *x, int64_t lo, int64_t hi) {
    float maximum = -INFINITY;
    int nans = 0;
    int64_t j = lo;
#if defined(__AVX2__)
    /* per lane: the largest value and the first index it was seen at (only a larger value replaces it) */
    __m256 lane_max = _mm256_set1_ps(-INFINITY), lane_nans = _mm256_setzero_ps();
    __m256i lane_index = _mm256_set1_epi32(0), index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    for (; j + 8 <= hi && j - lo < INT32_MAX - 8; j += 8, index = _mm256_add_epi32(index, step)) {
        const __m256 v = _mm256_loadu_ps(x + j);
        const __m256 larger = _mm256_cmp_ps(v, lane_max, _CMP_GT_OQ);
        lane_max = _mm256_blendv_ps(lane_max, v, larger);
        lane_index = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(lane_index),
                                                          _mm256_castsi256_ps(index), larger));
        lane_nans = _mm256_or_ps(lane_nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float maxima[8];
    int32_t indices[8];
    _mm256_storeu_ps(maxima, lane_max);
    _mm256_storeu_si256((__m256i *)indices, lane_index);
    nans = _mm256_movemask_ps(lane_nans) != 0;
    int64_t first = hi;
    for (int lane = 0; lane < 8; lane++) maximum = maxima[lane] > maximum ? maxima[lane] : maximum;
    for (int lane = 0; lane < 8; lane++)
        if (maxima[lane] == maximum && lo + indices[lane] < first) first = lo + indices[lane];
    if (first == hi) first = lo; /* every value -inf so far */
#else
    int64_t first = lo;
#endif
    for (int64_t k = j; k < hi; k++) {
        if (x[k] > maximum) maximum = x[k], first = k;
        nans += x[k] != x[k];
    }
    SpanMax out = {maximum, first, nans > 0};
    if (nans)
        for (int64_t k = lo; k < hi; k++)
            if (x[k] != x[k]) {
                out.index = k;
                break;
            }
    return out;
}

static float span_exp_sum(const float *x, int64_t lo, int64_t hi, float maximum) {
    float sum = 0.0f;
#pragma omp simd reduction(+:sum)
    for (int64_t j = lo; j < hi; j++) sum += exp_nonpositive(x[j] - maximum);
    return sum;
}

/* The earlier-in-the-row of two spans' results wins ties; a NaN anywhere wins. */
static SpanMax combine(SpanMax a, SpanMax b) {
    if (a.has_nan || b.has_nan) return a.has_nan ? a : b;
    return b.maximum > a.maximum ? b : a;
}

static float logprob_of(SpanMax m, float sum) {
    return (m.has_nan || !isfinite(m.maximum)) ? NAN : -logf(sum);
}

/* logits [rows, vocab] with row stride ``stride``; ids [rows] and logprobs [rows] out. Returns 0. */
int greedy_f32(const float *logits, int64_t rows, int64_t vocab, int64_t stride, int64_t *ids, float *logprobs) {
    const int threads = omp_get_max_threads() < MAX_THREADS ? omp_get_max_threads() : MAX_THREADS;
    if (rows >= threads || threads == 1) {
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float *x = logits + r * stride;
            SpanMax m = span_max(x, 0, vocab);
            ids[r] = m.index;
            logprobs[r] = logprob_of(m, m.has_nan ? NAN : span_exp_sum(x, 0, vocab, m.maximum));
        }
        return 0;
    }
    /* fewer rows than threads (batch 1): each row's vocabulary in one span per thread */
    SpanMax spans[MAX_THREADS];
    float sums[MAX_THREADS];
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * stride;
        SpanMax m;
#pragma omp parallel num_threads(threads)
        {
            const int t = omp_get_thread_num(), n = omp_get_num_threads();
            const int64_t lo = vocab * t / n, hi = vocab * (t + 1) / n;
            spans[t] = span_max(x, lo, hi);
#pragma omp barrier
#pragma omp single
            {
                m = spans[0];
                for (int k = 1; k < n; k++) m = combine(m, spans[k]);
            }
            sums[t] = m.has_nan ? 0.0f : span_exp_sum(x, lo, hi, m.maximum);
#pragma omp barrier
#pragma omp single
            {
                float sum = 0.0f;
                for (int k = 0; k < n; k++) sum += sums[k];
                ids[r] = m.index;
                logprobs[r] = logprob_of(m, sum);
            }
        }
    }
    return 0;
}
