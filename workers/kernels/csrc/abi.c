/* The library's half of the check that it and workers/kernels/bindings.py agree: the sizes of the shared
 * structures and the values of the shared constants, by name. The loader asks for each of its own and
 * refuses a library that answers differently, so a field added on one side only fails at load, not as a
 * misread pointer in the middle of a step. */
#include "llmbus_kernels.h"

#include <string.h>

typedef struct {
    const char *name;
    int64_t value;
} AbiEntry;

static const AbiEntry ABI[] = {
    {"sizeof(Tiled)", sizeof(Tiled)},
    {"sizeof(Proj)", sizeof(Proj)},
    {"sizeof(Experts)", sizeof(Experts)},
    {"sizeof(LayerArgs)", sizeof(LayerArgs)},
    {"sizeof(StepArgs)", sizeof(StepArgs)},
    {"sizeof(LoraSite)", sizeof(LoraSite)},
    {"sizeof(LayerLora)", sizeof(LayerLora)},
    {"MAX_ROWS", MAX_ROWS},
    {"QUANT_TILE", QUANT_TILE},
    {"ACTIVATION_BLOCK", ACTIVATION_BLOCK},
    {"TILED_INT8", TILED_INT8},
    {"TILED_INT4", TILED_INT4},
    {"TILED_BF16", TILED_BF16},
    {"TILED_MXFP4", TILED_MXFP4},
    {"TILED_ISA_AVX2", TILED_ISA_AVX2},
    {"TILED_ISA_AVX512_BF16", TILED_ISA_AVX512_BF16},
};

int64_t llmbus_kernels_abi(const char *name) {
    for (size_t i = 0; i < sizeof ABI / sizeof ABI[0]; i++)
        if (strcmp(ABI[i].name, name) == 0) return ABI[i].value;
    return -1;
}
