/* The interface of llmbus's CPU kernel library: every structure and constant Python shares with it
 * (workers/kernels/bindings.py mirrors them with ctypes) and every entry point it exports. Each .c file
 * of this folder is its own translation unit of one shared library, built by workers/kernels/build.py with
 * -fvisibility=hidden: only what LLMBUS_API marks here is exported.
 *
 * A structure or constant changed here must change in bindings.py too: llmbus_kernels_abi reports their
 * sizes and values, and the loader compares them with its own before anything is called.
 */
#ifndef LLMBUS_KERNELS_H
#define LLMBUS_KERNELS_H

#include <stdint.h>

#define LLMBUS_API __attribute__((visibility("default")))

/* Batch rows one GEMV pass of the fused decode layer serves; larger batches go through gemm.c (float32). */
enum { MAX_ROWS = 8 };

/* Output rows per vector (a tile) of quant_kernels.c's weight layout. */
enum { QUANT_TILE = 16 };

/* Columns of a block integer_products.c quantizes activations in (MXFP4's block): int4 groups are whole ones,
 * and int8's are, or halves (Q6_K's 16). */
enum { ACTIVATION_BLOCK = 32 };

/* A projection's weight [out, in]: float32 rows, or int8 rows with a float32 scale per row and group of
 * ``group`` inputs (w = value * scale; quant.py's Int8Weight: scale [out, ceil(in / group)]), or both (the
 * int8 rows and their dequantized copy, which --quantize int8 keeps where float32 activations have no int8
 * kernel: the GEMVs stream the int8 rows, a quarter of the bytes; the GEMMs of larger batches, bound by
 * arithmetic, multiply the copy, as the torch path does). ``bf16``: the float32 rows again as bfloat16,
 * where every value of them is one (a bfloat16 checkpoint served in float32): the GEMVs stream those, half
 * the bytes, for the very same float32 numbers and sums. */
/* A projection in quant_kernels.c's tiled layout (its header): 16 output rows a vector, each lane summing its
 * row's products in input order whatever the batch, so a row's result does not depend on the rows beside
 * it. int8, int4 and MXFP4 with per-group scales (int4: and lows); bf16 with no scale (group = k_padded). */
enum { TILED_NONE = 0, TILED_INT8 = 1, TILED_INT4 = 2, TILED_BF16 = 3, TILED_MXFP4 = 4 };
typedef struct {
    const void *values; /* or null: not tiled */
    const float *scale, *low;
    int64_t kind, k_padded, group;
    int64_t split; /* float32 inputs as bf16 hi + lo (~16 significant bits), else rounded to bf16 */
} Tiled;

typedef struct Proj {
    const float *dense;   /* or null: int8 only */
    const int8_t *values; /* or null: float32 only */
    const float *scale;
    int64_t group;
    const uint16_t *bf16; /* or null */
    Tiled tiled;          /* values null, or the form every GEMV of this projection reads */
    /* A tiled projection stacked from parts of different forms (a GGUF's Q6_K v beside Q4_K q and k): this
     * part gives the first ``rows`` outputs and ``next`` the rest; null: this part gives them all. */
    const struct Proj *next;
    int64_t rows;
} Proj;

/* A layer's routed experts (Mixtral, Qwen3-MoE; workers/models/moe.py): a float32 router [num_experts,
 * hidden], softmax over its logits, the top_k experts of each row (their probabilities rescaled to sum to one
 * where ``renormalize``), each a SwiGLU MLP of ``intermediate`` with a fused gate/up projection. */
typedef struct {
    const float *router;
    const Proj *gate_ups, *downs; /* [num_experts] each */
    int64_t num_experts, top_k, renormalize, intermediate;
} Experts;

/* One projection's LoRA adapters (workers/lora.py): every adapter's A [slots, rank, in] and B transposed
 * [slots, rank, out], float32, zero-padded to the largest rank; slot 0 (the base model) is never read; and per
 * (slot, rank) the outputs its row of B^T reaches, [out_first, out_last) (empty: a padded rank; one part of a
 * fused projection: the q, k and v adapters stacked block-diagonally). shrink null: no adapter adapts it. */
typedef struct {
    const float *shrink, *expand_t;
    int64_t rank;
    const int64_t *out_first, *out_last;
} LoraSite;

/* A layer's LoRA adapters, by projection. */
typedef struct {
    LoraSite qkv, o_proj, gate_up, down;
} LayerLora;

/* One decoder layer's weights for decode_layers_f32. */
typedef struct {
    const float *input_norm, *qkv_bias, *o_bias, *post_norm, *gate_up_bias, *down_bias;
    Proj qkv, o_proj, gate_up, down; /* gate_up and down empty where ``experts`` is set */
    int64_t window; /* which of StepArgs.starts this layer attends with (its sliding window, or none) */
    const float *q_norm, *k_norm; /* or null: per-head RMSNorm weights [head_dim] on queries and keys before RoPE (Qwen3) */
    const Experts *experts;       /* or null: the dense MLP above */
    const LayerLora *lora;        /* or null: no LoRA adapter adapts this layer */
} LayerArgs;

/* One step of decode_layers_f32: its shapes, its per-row inputs, scratch, and the paged pool. */
typedef struct {
    int64_t batch, hidden, intermediate, num_heads, num_kv_heads, head_dim;
    int64_t pool_blocks, block_size, table_stride, scores_stride;
    float eps, scale;
    const float *cos, *sin;                    /* [B, D], sin signed as RotaryEmbedding.cos_sin gives it */
    const int64_t *slots, *tables, *lens;      /* [B], [B, table_stride], [B] */
    float *normed, *qkv_out, *attended, *act;  /* scratch: [B, H], [B, (Hq + 2 Hkv) D], [B, Hq D], [B, I] */
    float *scores;                             /* [attention_threads(), group, scores_stride] */
    int64_t rows_share_sequences;              /* rows are positions of one sequence (speculation) */
    float *gate_up_out, *panels;               /* batches past MAX_ROWS: [B, 2 I], decode_layer_panel_floats */
    void *pool_key, *pool_value;               /* every layer's pool, one after the other */
    int64_t pool_layer_stride;                 /* elements from one layer's pool to the next */
    const int64_t *const *starts;              /* per window: [B] first visible key */
    int64_t pool_f16;                          /* the pool holds float16 K/V (--kv-cache-dtype), else float32 */
    uint16_t *prepared;                        /* tiled projections' inputs as bf16 pairs: [2 B, widest k_padded] */
    float *prepared_sums;                      /* and their group sums (int4): [2 B, most groups] */
    /* layers with experts (scratch; gate_up_out and act then hold the widest MLP of either kind):
     * [B, most experts] router probabilities; [2 B top_k] routing weights, by row and then by expert; [B, H]
     * each of the rows an expert takes, its outputs and the rows' weighted sums; [2 B top_k + most experts
     * + 1] the chosen experts by row, the rows by expert, and where each expert's rows start */
    float *expert_probs, *expert_weights, *expert_in, *expert_out, *expert_sum;
    int64_t *expert_rows;
    /* LoRA: each row's adapter slot (0: the base model), or null when no row has one; and scratch
     * [B, the largest rank of any projection] for the rows' shrunk inputs */
    const int32_t *adapter_slots;
    float *lora_scratch;
} StepArgs;

/* The library's side of the ABI check: the value of ``name`` (a constant above, or "sizeof(Proj)",
 * "sizeof(LayerArgs)", "sizeof(StepArgs)"), -1 for a name it does not know. */
LLMBUS_API int64_t llmbus_kernels_abi(const char *name);

/* decode_attention.c: decode attention over one layer's paged pool (see its header for the arguments),
 * per pool dtype: bf16 (bfloat16 activations and pool), f32, f16kv (float32 activations, float16 pool).
 * Returns 0, or -1 for a shape it cannot take. */
#define LLMBUS_DECODE_ATTENTION(NAME, A, P)                                                                  \
    LLMBUS_API int NAME(const A *query, int64_t query_stride, const A *new_key, int64_t key_stride,         \
                        const A *new_value, int64_t value_stride, P *pool_key, P *pool_value,               \
                        int64_t pool_blocks, int64_t block_size, const int64_t *slots, const int64_t *tables, \
                        int64_t table_stride, A *out, const int64_t *lens, const int64_t *starts,           \
                        int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,           \
                        float scale, float softcap, const float *sinks, float *scratch, int64_t scores_stride)
LLMBUS_DECODE_ATTENTION(decode_attention_bf16, uint16_t, uint16_t);
LLMBUS_DECODE_ATTENTION(decode_attention_f32, float, float);
LLMBUS_DECODE_ATTENTION(decode_attention_f16kv, float, uint16_t);
/* The slots the attention scratch must have (its [slots, group, scores_stride]): one a thread that attends. */
LLMBUS_API int64_t attention_threads(void);

/* decode_attention.c: tokens' K/V [T, Hkv, D] into one layer's pool at slots [T], per pool dtype. */
#define LLMBUS_WRITE_KV(NAME, A, P)                                                                          \
    LLMBUS_API void NAME(const A *new_key, int64_t key_stride, const A *new_value, int64_t value_stride,    \
                         P *pool_key, P *pool_value, int64_t pool_blocks, int64_t block_size,               \
                         const int64_t *slots, int64_t tokens, int64_t num_kv_heads, int64_t head_dim)
LLMBUS_WRITE_KV(write_kv_bf16, uint16_t, uint16_t);
LLMBUS_WRITE_KV(write_kv_f32, float, float);
LLMBUS_WRITE_KV(write_kv_f16kv, float, uint16_t);

/* decode_layer.c: every layer of a step in one call, the final norm and LM head, one projection's GEMV,
 * and what this build of it takes. */
LLMBUS_API int decode_layers_f32(const StepArgs *s, const LayerArgs *layers, int64_t num_layers, float *hidden);
LLMBUS_API int lm_head_f32(const Proj *weight, const float *norm, float eps, const float *x, int64_t in,
                           int64_t out_features, int64_t rows, float *normed, float *y, uint16_t *prepared,
                           float *prepared_sums);
LLMBUS_API int gemv_proj(const Proj *weight, const float *bias, const float *x, int64_t in, int64_t out_features,
                         int64_t rows, float *y, uint16_t *prepared, float *prepared_sums);
LLMBUS_API int decode_layer_reads_bf16(void);
LLMBUS_API int64_t decode_layer_panel_floats(int64_t rows, int64_t widest);

/* gemm.c: y = x w^T (+ bias) in float32, where this build runs it (gemm_f32_runs). */
LLMBUS_API int gemm_f32_runs(void);
LLMBUS_API int gemm_f32(const float *x, const float *w, const float *bias, int64_t m, int64_t n, int64_t k,
                        float *y);

/* quant_kernels.c: weight-only int8 / int4 / MXFP4 / bf16 products, where this build has a tiled kernel
 * (tiled_kernel_isa: AVX512-BF16's, or AVX2 + FMA's with the same numbers; none: the products return -1). */
enum { TILED_ISA_NONE = 0, TILED_ISA_AVX2 = 1, TILED_ISA_AVX512_BF16 = 2 };
LLMBUS_API int tiled_kernel_isa(void);
LLMBUS_API int int8_matmul(const void *x, int x_is_f32, int split, int64_t m, int64_t k, int64_t x_stride,
                           const int8_t *values, const float *scale, int64_t n, int64_t k_padded, int64_t group,
                           const float *bias, void *y, uint16_t *rows, float *sums);
LLMBUS_API int bf16_matmul(const void *x, int x_is_f32, int split, int64_t m, int64_t k, int64_t x_stride,
                           const uint16_t *values, int64_t n, int64_t k_padded, const float *bias, void *y,
                           uint16_t *rows);
LLMBUS_API int int4_matmul(const void *x, int x_is_f32, int split, int64_t m, int64_t k, int64_t x_stride,
                           const uint8_t *values, const float *scale, const float *low, int64_t n,
                           int64_t k_padded, int64_t group, const float *bias, void *y, uint16_t *rows,
                           float *sums);

LLMBUS_API int mxfp4_matmul(const void *x, int x_is_f32, int split, int64_t m, int64_t k, int64_t x_stride,
                            const uint8_t *values, const uint8_t *scale, int64_t n, int64_t k_padded, int64_t group,
                            const float *bias, void *y, uint16_t *rows, float *sums);

/* sampling.c: the greedy choice and the inverse-CDF draw over float32 logits rows. */
LLMBUS_API int greedy_f32(const float *logits, int64_t rows, int64_t vocab, int64_t stride, int64_t *ids,
                          float *logprobs);
LLMBUS_API int sample_f32(const float *logits, const float *raw, int64_t rows, int64_t vocab, int64_t stride,
                          const uint8_t *sampled, const float *temperatures, const float *uniforms, float *scratch,
                          int64_t scratch_rows, int64_t *ids, float *logprobs);

#endif
