/* The kernels under target("avx2") on x86-64 (see kernel.h); module.c calls them only where the CPU has
 * AVX2. Elsewhere (another CPU, or Clang, which has no such pragma) this file is empty. */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2")
#define KV_FN(name) kv_##name##_avx2
#include "kernel.h"
#else
typedef int kv_no_avx2_kernels; /* (an empty translation unit is not ISO C) */
#endif
