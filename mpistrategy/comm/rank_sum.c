/* The sum of every rank's chunk, in rank order, written to any number of places: see rank_sum.py. */
#include <stddef.h>

#define BLOCK 512 /* elements summed at a time in a private buffer (2 KiB or 4 KiB): reads happen before writes */

/* x86-64: an AVX2 build of each sum beside the baseline (SSE2) one, picked at load time by the CPU */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WIDEST __attribute__((target_clones("avx2", "default")))
#else
#define WIDEST
#endif

#define DEFINE_SUM(NAME, T)                                                                                    \
    WIDEST static void NAME(size_t n, int count, const void *const *inputs, int targets, void *const *outputs, \
                            T scale, int scaled) {                                                             \
        T block[BLOCK];                                                                                        \
        for (size_t start = 0; start < n; start += BLOCK) {                                                    \
            size_t len = n - start < BLOCK ? n - start : BLOCK;                                                \
            const T *first = (const T *)inputs[0] + start;                                                     \
            for (size_t i = 0; i < len; i++) block[i] = first[i];                                              \
            for (int k = 1; k < count; k++) {                                                                  \
                const T *next = (const T *)inputs[k] + start;                                                  \
                for (size_t i = 0; i < len; i++) block[i] += next[i];                                          \
            }                                                                                                  \
            if (scaled)                                                                                        \
                for (size_t i = 0; i < len; i++) block[i] *= scale;                                            \
            for (int k = 0; k < targets; k++) {                                                                \
                T *out = (T *)outputs[k] + start;                                                              \
                for (size_t i = 0; i < len; i++) out[i] = block[i];                                            \
            }                                                                                                  \
        }                                                                                                      \
    }

DEFINE_SUM(sum_float, float)
DEFINE_SUM(sum_double, double)

/* dtype 0: float32, 1: float64 (the caller passes no other). */
void rank_sum(int dtype, size_t n, int count, const void *const *inputs, int targets, void *const *outputs,
              double scale) {
    int scaled = scale != 1.0;
    if (dtype == 0)
        sum_float(n, count, inputs, targets, outputs, (float)scale, scaled);
    else
        sum_double(n, count, inputs, targets, outputs, scale, scaled);
}
