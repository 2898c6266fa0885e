/* The last step of choosing tokens, for rows of float32 logits, in C: greedy rows' first argmax and its
 * log-softmax; sampled rows' inverse-CDF draw from the softmax of their (temperature-scaled, warped) logits
 * with the row's uniform number, and that token's log-probability. sampling.py decides which rows come
 * here; the warpers (top-k, top-p, typical-p) stay in torch.
 *
 * Why: torch does these as whole-batch passes that each read, and most write, [rows, vocab] floats:
 * argmax, log_softmax, then a gather; for sampling also a division by the temperatures, a NaN check, exp
 * and a cumulative sum, together a sizeable share of a large batch's step (design notes, "Choosing tokens
 * in C on CPU"). Here each row is read a few times while it is in L2, rows split across the threads, or a
 * single row's vocabulary split across them (greedy).
 *
 * Matches sampling.py's torch path: ties go to the first index; a greedy row with a NaN picks its first
 * NaN and gets a NaN log-probability, one with no finite maximum (all -inf, or a +inf) a NaN
 * log-probability, as log_softmax gives them. A sampled row's draw is the first token whose cumulative
 * probability passes u * total (kept below the total), over exp(log_softmax) as torch computes it; a row
 * whose log-softmax is not finite (a temperature so small that the scaled logits overflow) takes the
 * argmax with log-probability 0, the limit of the distribution. Sums are float32 in another order than
 * torch's: log-probabilities agree to float32 rounding, greedy ids exactly, and a draw can differ only
 * where u * total falls within that rounding of a boundary. Each row depends on nothing but itself.
 * Built on first use by workers/kernels/build.py, with the other kernels.
 */
#include "internal.h"

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

/* A greedy row's softmax sum is the sum, in order, of its vocabulary's fixed spans' sums (EXP_SPAN values each,
 * more where a vocabulary has over MAX_SPANS of them): the same float32 sum whether one thread reads the row or
 * the threads share its spans, so a token's logprob does not depend on the step's rows or the thread count
 * (issue #35 part 4). */
enum { EXP_SPAN = 4096, MAX_SPANS = 1024 };

static int64_t exp_span(int64_t vocab) {
    const int64_t per = (vocab + MAX_SPANS - 1) / MAX_SPANS;
    return per > EXP_SPAN ? per : EXP_SPAN;
}

static float row_exp_sum(const float *x, int64_t vocab, float maximum) {
    const int64_t span = exp_span(vocab);
    float sum = 0.0f;
    for (int64_t lo = 0; lo < vocab; lo += span) sum += span_exp_sum(x, lo, lo + span < vocab ? lo + span : vocab, maximum);
    return sum;
}

/* One greedy row, read by one thread: its first argmax and that token's log-softmax. */
static void greedy_row(const float *x, int64_t vocab, int64_t *id, float *logprob) {
    SpanMax m = span_max(x, 0, vocab);
    *id = m.index;
    *logprob = logprob_of(m, m.has_nan ? NAN : row_exp_sum(x, vocab, m.maximum));
}

/* logits [rows, vocab] with row stride ``stride``; ids [rows] and logprobs [rows] out. Returns 0. */
int greedy_f32(const float *logits, int64_t rows, int64_t vocab, int64_t stride, int64_t *ids, float *logprobs) {
    const int threads = omp_get_max_threads() < MAX_THREADS ? omp_get_max_threads() : MAX_THREADS;
    if (rows >= threads || threads == 1) {
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < rows; r++) greedy_row(logits + r * stride, vocab, &ids[r], &logprobs[r]);
        return 0;
    }
    /* fewer rows than threads (batch 1): each row's maximum over one span per thread, its sum over the fixed
     * spans of row_exp_sum shared among the threads and added in row_exp_sum's order */
    SpanMax spans[MAX_THREADS];
    float sums[MAX_SPANS];
    const int64_t span = exp_span(vocab), num_spans = (vocab + span - 1) / span;
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
            if (!m.has_nan) {
#pragma omp for schedule(static)
                for (int64_t k = 0; k < num_spans; k++)
                    sums[k] = span_exp_sum(x, k * span, (k + 1) * span < vocab ? (k + 1) * span : vocab, m.maximum);
            }
#pragma omp single
            {
                float sum = 0.0f;
                for (int64_t k = 0; k < num_spans; k++) sum += sums[k];
                ids[r] = m.index;
                logprobs[r] = logprob_of(m, sum);
            }
        }
    }
    return 0;
}

/* exp of a log-probability (<= 0); below float32's normal range, 0 (torch gives a subnormal there). */
#pragma omp declare simd
static inline float probability(float logprob) { return logprob < -87.0f ? 0.0f : exp_nonpositive(logprob); }

/* One drawn row: x / temperature, its log-softmax, and the inverse-CDF draw at u (see the top); ``raw``: the
 * row before the warpers masked it (x itself where none did). ``scratch``: vocab floats. */
static void sample_row(const float *x, const float *raw, int64_t vocab, float temperature, float u, float *scratch,
                       int64_t *id, float *logprob) {
    float maximum = -INFINITY;
    int nans = 0;
#pragma omp simd reduction(max:maximum) reduction(+:nans)
    for (int64_t j = 0; j < vocab; j++) {
        const float y = x[j] / temperature;
        scratch[j] = y;
        maximum = y > maximum ? y : maximum;
        nans += y != y;
    }
    float sum = 0.0f;
    if (!nans && isfinite(maximum)) {
#pragma omp simd reduction(+:sum)
        for (int64_t j = 0; j < vocab; j++) sum += probability(scratch[j] - maximum);
    }
    const float log_sum = logf(sum);
    if (nans || !isfinite(maximum) || !isfinite(log_sum)) {
        /* the limit distribution: everything on the first argmax of the logits before any warper */
        SpanMax m = span_max(raw, 0, vocab);
        *id = m.index;
        *logprob = 0.0f;
        return;
    }
#pragma omp simd
    for (int64_t j = 0; j < vocab; j++) scratch[j] = probability((scratch[j] - maximum) - log_sum);
    float total = 0.0f;
    for (int64_t j = 0; j < vocab; j++) scratch[j] = total += scratch[j];
    float target = u * total;
    const float below = nextafterf(total, 0.0f);
    if (target > below) target = below;
    /* the first index whose running total passes the target (searchsorted, right) */
    int64_t lo = 0, hi = vocab - 1;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (scratch[mid] > target) hi = mid;
        else lo = mid + 1;
    }
    *id = lo;
    *logprob = (x[lo] / temperature - maximum) - log_sum;
}

/* logits [rows, vocab] (row stride ``stride``), and ``raw``, the same rows before the warpers (the same
 * pointer where none ran); per row: sampled (0: greedy, 1: draw), temperature and uniform (read for drawn
 * rows); ids [rows] and logprobs [rows] out; ``scratch``: scratch_rows * vocab floats (one row per thread:
 * no more threads run than that). Returns 0. */
int sample_f32(const float *logits, const float *raw, int64_t rows, int64_t vocab, int64_t stride,
               const uint8_t *sampled, const float *temperatures, const float *uniforms, float *scratch,
               int64_t scratch_rows, int64_t *ids, float *logprobs) {
    const int threads = omp_get_max_threads() < scratch_rows ? omp_get_max_threads() : (int)scratch_rows;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * stride;
        if (sampled[r]) {
            sample_row(x, raw + r * stride, vocab, temperatures[r], uniforms[r],
                       scratch + (int64_t)omp_get_thread_num() * vocab, &ids[r], &logprobs[r]);
        } else {
            greedy_row(x, vocab, &ids[r], &logprobs[r]);
        }
    }
    return 0;
}
