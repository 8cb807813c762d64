/* The kernels for the instruction set the compiler targets by default (see kernel.h). */
#define KV_FN(name) kv_##name##_base
#include "kernel.h"
