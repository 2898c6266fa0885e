/* exp of a non-positive float that the compiler vectorises, shared by the CPU kernels (internal.h includes
 * it): softmax (decode_attention.c), SiLU (decode_layer.c) and choosing tokens (sampling.c). */
#ifndef LLMBUS_FAST_EXP
#define LLMBUS_FAST_EXP
#include <math.h>
#include <stdint.h>
#include <string.h>

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
#endif
