/* float32 projections on CPU: y[m, n] = x[m, k] . w[n, k]^T (+ bias[n]), reading the weight as checkpoints
 * store it ([out, in] row-major), so one copy serves this GEMM and decode_layer.c's GEMVs.
 *
 * Why our own: on a 2-core AVX2 machine (float32, SmolLM2's shapes) this register tile runs near the two FMA
 * pipes' peak at 64 rows, faster than oneDNN's GEMM with a weight reordered at load time (design notes,
 * "float32 GEMMs: our own register tile on AVX2"). Built only for AVX2 + FMA without AVX-512
 * (gemm_f32_runs): that is what it was measured on, and oneDNN's AVX-512 kernels are twice as wide.
 *
 * Scheme: x is taken MC rows at a time and transposed into panels of 16 rows ([panel][k][16], zero past m)
 * that stay in L2; a 6 x 16 tile (6 weight rows against one panel, 12 accumulators) runs over KC inputs at
 * a time, its 6 weight rows staying in L1 for every panel of the block. The threads split the weight rows.
 * The weight streams from memory once per MC rows of x, prefetched a tile ahead. Each output is one
 * sequential sum over k per KC block, as the torch path's GEMMs keep it, up to float32 rounding order.
 */
#include "internal.h"

#include <stdint.h>
#include <stdlib.h>

#if GEMM_RUNS
#include <immintrin.h>
#include <omp.h>

enum { NR = 6, MR = 16, MC = 128, KC = 768 };

/* Rows [row0, row0 + rows) of x [m, k] as panels of MR rows: panel p at out + p * k * MR, [k][MR]. */
static void pack_panel(const float *x, int64_t k, int64_t row0, int64_t rows, float *out) {
    for (int64_t r = 0; r < MR; r++) {
        if (r < rows) {
            const float *src = x + (row0 + r) * k;
            for (int64_t t = 0; t < k; t++) out[t * MR + r] = src[t];
        } else {
            for (int64_t t = 0; t < k; t++) out[t * MR + r] = 0.0f;
        }
    }
}

/* out[i][r] = sum over t < kc of w[i][t] * panel[t][r]; ``next`` (or null): rows to prefetch, one cache line
 * of each per 16 inputs, so the next tile's weights arrive while this one computes. */
static inline void tile_6x16(const float *const w[NR], const float *const next[NR], const float *panel,
                             int64_t kc, float out[NR][MR]) {
    __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps(),
           c11 = _mm256_setzero_ps(), c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps(),
           c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps(), c40 = _mm256_setzero_ps(),
           c41 = _mm256_setzero_ps(), c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
    const float *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3], *w4 = w[4], *w5 = w[5];
    for (int64_t t = 0; t < kc; t++) {
        if (next != 0 && (t & 15) == 0)
            for (int i = 0; i < NR; i++) _mm_prefetch((const char *)(next[i] + t), _MM_HINT_T0);
        const __m256 b0 = _mm256_load_ps(panel + t * MR), b1 = _mm256_load_ps(panel + t * MR + 8);
        __m256 a = _mm256_broadcast_ss(w0 + t);
        c00 = _mm256_fmadd_ps(a, b0, c00), c01 = _mm256_fmadd_ps(a, b1, c01);
        a = _mm256_broadcast_ss(w1 + t);
        c10 = _mm256_fmadd_ps(a, b0, c10), c11 = _mm256_fmadd_ps(a, b1, c11);
        a = _mm256_broadcast_ss(w2 + t);
        c20 = _mm256_fmadd_ps(a, b0, c20), c21 = _mm256_fmadd_ps(a, b1, c21);
        a = _mm256_broadcast_ss(w3 + t);
        c30 = _mm256_fmadd_ps(a, b0, c30), c31 = _mm256_fmadd_ps(a, b1, c31);
        a = _mm256_broadcast_ss(w4 + t);
        c40 = _mm256_fmadd_ps(a, b0, c40), c41 = _mm256_fmadd_ps(a, b1, c41);
        a = _mm256_broadcast_ss(w5 + t);
        c50 = _mm256_fmadd_ps(a, b0, c50), c51 = _mm256_fmadd_ps(a, b1, c51);
    }
    _mm256_storeu_ps(out[0], c00), _mm256_storeu_ps(out[0] + 8, c01);
    _mm256_storeu_ps(out[1], c10), _mm256_storeu_ps(out[1] + 8, c11);
    _mm256_storeu_ps(out[2], c20), _mm256_storeu_ps(out[2] + 8, c21);
    _mm256_storeu_ps(out[3], c30), _mm256_storeu_ps(out[3] + 8, c31);
    _mm256_storeu_ps(out[4], c40), _mm256_storeu_ps(out[4] + 8, c41);
    _mm256_storeu_ps(out[5], c50), _mm256_storeu_ps(out[5] + 8, c51);
}

/* The calling thread's panel buffer, grown as needed and kept: a fresh one per call would page-fault. */
static float *panels_for(int64_t floats) {
    static __thread float *buffer;
    static __thread int64_t capacity;
    if (floats > capacity) {
        void *grown = 0;
        if (posix_memalign(&grown, 64, (size_t)floats * sizeof(float)) != 0) return 0;
        free(buffer);
        buffer = grown, capacity = floats;
    }
    return buffer;
}

int64_t gemm_panel_floats(int64_t m, int64_t k) { return ((m < MC ? m : MC) + MR - 1) / MR * MR * k; }

/* y (+)= x w^T (+ bias) with y's rows ``y_stride`` apart: each thread of the enclosing parallel region
 * calls it (it shares the work out and ends on a barrier); ``panels`` (gemm_panel_floats) is shared.
 * ``accumulate`` adds to y (a residual) instead of overwriting it. */
void gemm_team(const float *x, const float *w, const float *bias, int64_t m, int64_t n, int64_t k,
                      float *y, int64_t y_stride, int accumulate, float *panels) {
    const int64_t tiles = (n + NR - 1) / NR;
    for (int64_t m0 = 0; m0 < m; m0 += MC) {
        const int64_t rows = m - m0 < MC ? m - m0 : MC, num_panels = (rows + MR - 1) / MR;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; p++) {
            const int64_t left = rows - p * MR;
            pack_panel(x, k, m0 + p * MR, left < MR ? left : MR, panels + p * k * MR);
        }
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t n0 = tile * NR;
            for (int64_t k0 = 0; k0 < k; k0 += KC) {
                const int64_t kc = k - k0 < KC ? k - k0 : KC;
                const float *rows_w[NR], *next[NR];
                for (int i = 0; i < NR; i++) { /* rows past n repeat row n0: computed, never stored */
                    rows_w[i] = w + (n0 + i < n ? n0 + i : n0) * k + k0;
                    next[i] = w + (n0 + NR + i < n ? n0 + NR + i : n0) * k + k0;
                }
                const int add = accumulate || k0 > 0;
                for (int64_t p = 0; p < num_panels; p++) {
                    float out[NR][MR];
                    tile_6x16(rows_w, p == 0 ? next : 0, panels + p * k * MR + k0 * MR, kc, out);
                    for (int64_t r = 0; r < MR && p * MR + r < rows; r++) {
                        float *dst = y + (m0 + p * MR + r) * y_stride + n0;
                        for (int64_t i = 0; i < NR && n0 + i < n; i++) {
                            const float value = k0 == 0 && bias != 0 ? bias[n0 + i] + out[i][r] : out[i][r];
                            dst[i] = add ? dst[i] + value : value;
                        }
                    }
                }
            }
        }
    }
}

int gemm_f32_runs(void) { return 1; }

int gemm_f32(const float *x, const float *w, const float *bias, int64_t m, int64_t n, int64_t k, float *y) {
    if (m <= 0 || n <= 0 || k <= 0) return -1;
    float *panels = panels_for(gemm_panel_floats(m, k));
    if (panels == 0) return -1;
#pragma omp parallel
    gemm_team(x, w, bias, m, n, k, y, n, 0, panels);
    return 0;
}
#else
int gemm_f32_runs(void) { return 0; }

int gemm_f32(const float *x, const float *w, const float *bias, int64_t m, int64_t n, int64_t k, float *y) {
    (void)x, (void)w, (void)bias, (void)m, (void)n, (void)k, (void)y;
    return -1;
}
#endif
