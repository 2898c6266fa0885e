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
 * decode_attention.c's pairs, projects through layer_projections.h and, past MAX_ROWS rows, multiplies
 * through gemm.c (internal.h).
 */
#include "internal.h"
#include "layer_projections.h"

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
                   s->lens[b], D, group, s->scale, 0.0f, 0, scores, s->scores_stride, out);
    else
        pair_f32(query, (const float *)l->pool_key + kv_head * head_elems,
                 (const float *)l->pool_value + kv_head * head_elems, table, s->block_size, l->starts[b], s->lens[b],
                 D, group, s->scale, 0.0f, 0, scores, s->scores_stride, out);
}

/* RoPE on the step's queries and keys, the new K/V into the pool, and attention, for every (kv head, row)
 * pair; called inside the layer's parallel region. */
static inline void rope_write_attend(const StepArgs *s, const LayerPool *l, const LayerArgs *w) {
    const int64_t B = s->batch, D = s->head_dim, Hq = s->num_heads, Hkv = s->num_kv_heads, group = Hq / Hkv;
    const int64_t qkv_width = (Hq + 2 * Hkv) * D, head_elems = s->pool_blocks * s->block_size * D;
#pragma omp for schedule(guided)
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
#pragma omp for schedule(guided)
        for (int64_t pair = 0; pair < Hkv * B; pair++) attend_pair(s, l, pair, head_elems, qkv_width, group);
    }
}

/* SiLU(gate) * up, with the sigmoid from exp of a non-positive argument on either side of zero. */
#pragma omp declare simd
static inline float silu_times(float gate, float up) {
    const float e = exp_nonpositive(gate < 0.0f ? gate : -gate);
    return gate * (gate < 0.0f ? e : 1.0f) / (1.0f + e) * up;
}

/* act = SiLU(gate) * up for the first ``rows`` rows of gate_up_out ([rows, 2 I]); called inside the step's parallel
 * region. */
static inline void silu_rows(const StepArgs *s, int64_t rows, int64_t I) {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < rows; b++) {
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
        silu_rows(s, count, I);
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

#define LORA_OUT_BLOCK 256

/* y[b] += B_a (A_a x[b]) for each row b on an adapter a (StepArgs.adapter_slots; base rows untouched, so their
 * arithmetic is the same with or without adapter rows beside them): the rows' shrunk inputs, rank by rank (each
 * of A's rows read once for all the rows, from cache after the first), then their expansions block of outputs
 * by block (B^T's rows contiguous over the outputs: a vector FMA pass per rank, the block's share of B^T read
 * once for all the rows), each rank only over the outputs its row of B^T reaches (LoraSite.out_first/out_last:
 * the q, k and v adapters' block-diagonal stack is two thirds zeros). Called by every thread of the step's parallel region; ends on a barrier. */
static void lora_add(const StepArgs *s, const LayerArgs *l, const LoraSite *site, const float *x, int64_t in,
                     int64_t out_features, float *y, int64_t y_stride) {
    if (l->lora == 0 || site->shrink == 0 || s->adapter_slots == 0) return;
    const int64_t B = s->batch, R = site->rank;
    float *shrunk = s->lora_scratch;
#pragma omp for schedule(static)
    for (int64_t rb = 0; rb < R * B; rb++) {
        const int64_t r = rb / B, b = rb % B, slot = s->adapter_slots[b];
        if (slot == 0 || site->out_first[slot * R + r] >= site->out_last[slot * R + r]) continue;
        const float *a = site->shrink + (slot * R + r) * in, *row = x + b * in;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t k = 0; k < in; k++) sum += a[k] * row[k];
        shrunk[b * R + r] = sum;
    }
    const int64_t blocks = (out_features + LORA_OUT_BLOCK - 1) / LORA_OUT_BLOCK;
#pragma omp for schedule(static)
    for (int64_t block = 0; block < blocks; block++) {
        const int64_t first = block * LORA_OUT_BLOCK;
        const int64_t last = first + LORA_OUT_BLOCK < out_features ? first + LORA_OUT_BLOCK : out_features;
        for (int64_t b = 0; b < B; b++) {
            const int64_t slot = s->adapter_slots[b];
            if (slot == 0) continue;
            float *out = y + b * y_stride;
            for (int64_t r = 0; r < R; r++) {
                const int64_t from = site->out_first[slot * R + r] > first ? site->out_first[slot * R + r] : first;
                const int64_t to = site->out_last[slot * R + r] < last ? site->out_last[slot * R + r] : last;
                const float t = shrunk[b * R + r], *e = site->expand_t + (slot * R + r) * out_features;
#pragma omp simd
                for (int64_t o = from; o < to; o++) out[o] += t * e[o];
            }
        }
    }
}

static inline int lora_adapts(const StepArgs *s, const LayerArgs *l, const LoraSite *site) {
    return s->adapter_slots != 0 && l->lora != 0 && site->shrink != 0;
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
    if (l->lora != 0) lora_add(s, l, &l->lora->qkv, s->normed, H, qkv_width, s->qkv_out, qkv_width);
    rope_write_attend(s, pool, l);
    gemm_team(s->attended, l->o_proj.dense, l->o_bias, B, H, Hq * D, hidden, H, 1, s->panels);
    if (l->lora != 0) lora_add(s, l, &l->lora->o_proj, s->attended, Hq * D, H, hidden, H);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; b++) rms_norm(hidden + b * H, l->post_norm, H, s->eps, s->normed + b * H);
    gemm_team(s->normed, l->gate_up.dense, l->gate_up_bias, B, 2 * I, H, s->gate_up_out, 2 * I, 0, s->panels);
    if (l->lora != 0) lora_add(s, l, &l->lora->gate_up, s->normed, H, 2 * I, s->gate_up_out, 2 * I);
    silu_rows(s, B, I);
    gemm_team(s->act, l->down.dense, l->down_bias, B, H, I, hidden, H, 1, s->panels);
    if (l->lora != 0) lora_add(s, l, &l->lora->down, s->act, I, H, hidden, H);
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
    if (l->lora != 0) lora_add(s, l, &l->lora->qkv, s->normed, H, qkv_width, s->qkv_out, qkv_width);
    rope_write_attend(s, pool, l);
    project(s, &l->o_proj, l->o_bias, s->attended, Hq * D, H, hidden, H, 1);
    if (l->lora != 0) lora_add(s, l, &l->lora->o_proj, s->attended, Hq * D, H, hidden, H);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; b++) rms_norm(hidden + b * H, l->post_norm, H, s->eps, s->normed + b * H);
    if (l->experts != 0) {
        routed_experts(s, l->experts, hidden);
        return;
    }
    /* every row the same arithmetic, whatever the batch; and where an adapter adapts gate/up, its delta goes
     * in before SiLU */
    if (l->gate_up.tiled.values != 0 || (l->lora != 0 && lora_adapts(s, l, &l->lora->gate_up))) {
        project(s, &l->gate_up, l->gate_up_bias, s->normed, H, 2 * I, s->gate_up_out, 2 * I, 0);
        if (l->lora != 0) lora_add(s, l, &l->lora->gate_up, s->normed, H, 2 * I, s->gate_up_out, 2 * I);
        silu_rows(s, B, I);
        project(s, &l->down, l->down_bias, s->act, I, H, hidden, H, 1);
        if (l->lora != 0) lora_add(s, l, &l->lora->down, s->act, I, H, hidden, H);
        return;
    }
    /* gate row i and up row I + i together: SiLU(gate) * up needs no second pass */
#pragma omp for schedule(guided)
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
    if (l->lora != 0) lora_add(s, l, &l->lora->down, s->act, I, H, hidden, H);
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
            tiled_parts(weight, 0, input, in, out_features, rows, y, out_features, 0, prepared, prepared_sums);
        else
            gemv(weight, 0, input, in, out_features, rows, y, out_features, 0);
    }
    return 0;
}

/* y [rows, out] = x [rows, in] W^T (+ bias) for one projection as a layer computes it (float32 or int8 rows, or
 * tiled, of parts or not). */
int gemv_proj(const Proj *weight, const float *bias, const float *x, int64_t in, int64_t out_features, int64_t rows,
              float *y, uint16_t *prepared, float *prepared_sums) {
#pragma omp parallel
    {
        if (weight->tiled.values != 0)
            tiled_parts(weight, bias, x, in, out_features, rows, y, out_features, 0, prepared, prepared_sums);
        else
            gemv(weight, bias, x, in, out_features, rows, y, out_features, 0);
    }
    return 0;
}
