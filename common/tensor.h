/* Tensors and number formats shared by every layer of the program.
 *
 * A tensor is a view: it never owns its data (weights live in the memory-mapped checkpoint,
 * activations in buffers the runner owns). Shapes are row-major, shape[0] outermost. */
#ifndef MOESERVE_TENSOR_H
#define MOESERVE_TENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    DTYPE_F32,
    DTYPE_F16,
    DTYPE_BF16,
    DTYPE_F64,
    DTYPE_I8,
    DTYPE_I16,
    DTYPE_I32,
    DTYPE_I64,
    DTYPE_U8,
    DTYPE_U16,
    DTYPE_U32,
    DTYPE_U64,
    DTYPE_BOOL,
    DTYPE_F8_E4M3,
    DTYPE_F8_E5M2,
    DTYPE_COUNT
} dtype;

/* Bytes per element. */
size_t dtype_size(dtype t);
/* The safetensors spelling ("BF16", "F8_E4M3", ...). */
const char *dtype_name(dtype t);
/* Parse a safetensors dtype string; returns false when unknown. */
bool dtype_parse(const char *s, dtype *out);

typedef enum { DEVICE_CPU, DEVICE_CUDA } device_kind;

#define TENSOR_MAX_DIMS 8

typedef struct {
    dtype dtype;
    int ndim;
    int64_t shape[TENSOR_MAX_DIMS];
    void *data;
    device_kind device;
} tensor;

static inline int64_t tensor_numel(const tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

static inline size_t tensor_nbytes(const tensor *t) {
    return (size_t)tensor_numel(t) * dtype_size(t->dtype);
}

/* bfloat16 <-> float32. The widening is exact; the narrowing rounds to nearest even and keeps
 * NaN a NaN. */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* "[2, 3]" into buf[n] (truncated to fit). */
void tensor_format_shape(char *buf, size_t n, int ndim, const int64_t *shape);

/* IEEE half -> float32 (exact). */
float f16_to_f32(uint16_t h);

/* Element i of a floating-point tensor of dtype F32, BF16 or F16, as float32. */
static inline float tensor_get_f32(const tensor *t, int64_t i) {
    switch (t->dtype) {
    case DTYPE_F32: return ((const float *)t->data)[i];
    case DTYPE_BF16: return bf16_to_f32(((const uint16_t *)t->data)[i]);
    case DTYPE_F16: return f16_to_f32(((const uint16_t *)t->data)[i]);
    default: return 0.0f;
    }
}

#ifdef __cplusplus
}
#endif

#endif
