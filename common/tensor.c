/* dtype tables and conversions. */
#include "common/tensor.h"

#include <stdio.h>

static const struct {
    const char *name;
    size_t size;
} dtype_table[DTYPE_COUNT] = {
    [DTYPE_F32] = {"F32", 4},     [DTYPE_F16] = {"F16", 2},         [DTYPE_BF16] = {"BF16", 2},
    [DTYPE_F64] = {"F64", 8},     [DTYPE_I8] = {"I8", 1},           [DTYPE_I16] = {"I16", 2},
    [DTYPE_I32] = {"I32", 4},     [DTYPE_I64] = {"I64", 8},         [DTYPE_U8] = {"U8", 1},
    [DTYPE_U16] = {"U16", 2},     [DTYPE_U32] = {"U32", 4},         [DTYPE_U64] = {"U64", 8},
    [DTYPE_BOOL] = {"BOOL", 1},   [DTYPE_F8_E4M3] = {"F8_E4M3", 1}, [DTYPE_F8_E5M2] = {"F8_E5M2", 1},
};

size_t dtype_size(dtype t) { return (unsigned)t < DTYPE_COUNT ? dtype_table[t].size : 0; }

const char *dtype_name(dtype t) { return (unsigned)t < DTYPE_COUNT ? dtype_table[t].name : "?"; }

bool dtype_parse(const char *s, dtype *out) {
    for (int i = 0; i < DTYPE_COUNT; i++) {
        if (strcmp(s, dtype_table[i].name) == 0) {
            *out = (dtype)i;
            return true;
        }
    }
    return false;
}

void tensor_format_shape(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t used = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && used < n; i++)
        used += (size_t)snprintf(buf + used, n - used, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (used < n) snprintf(buf + used, n - used, "]");
}

float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: renormalize */
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while (!(man & 0x400));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
