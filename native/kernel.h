/* The copy kernels, compiled once per instruction set: kernel_base.c (what the compiler targets by
 * default) and, on x86-64 with GCC, kernel_avx2.c (the same code under target("avx2"), where
 * xxHash's XXH3 takes its AVX2 path). The includer defines KV_FN(name), the suffix of its functions.
 *
 * A block is copied in chunks through a bounce buffer that stays in L1: each chunk is read once from
 * the source, hashed there and written to the destination with non-temporal stores. The checksum is
 * therefore of exactly the bytes written, even if the source changes meanwhile (a slot of a shared
 * arena that another process reuses), and a copy of megabytes neither reads the destination first nor
 * evicts the caller's working set from the caches. Copies under KV_NT_MIN bytes are plain memcpy (and a
 * hash): the stores and the fence are not worth it there. KV_NT_MIN is 8 KiB: same-node gets of 16 KiB
 * blocks went 0.49 -> 0.53 of memcpy with it at 8 KiB rather than 32 (docs/BENCHMARKS.md, run AD). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include "xxhash.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#define KV_HAVE_STREAM 1
#endif

#define KV_CHUNK 16384
#define KV_NT_MIN 8192

#ifdef KV_HAVE_STREAM
/* dst[0:n] = src[0:n], streaming the 16-byte-aligned middle of dst past the caches. */
static void KV_FN(stream)(char *dst, const char *src, size_t n) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
}
#define KV_STREAM(d, s, n) KV_FN(stream)(d, s, n)
#define KV_FENCE() _mm_sfence()
#else
#define KV_STREAM(d, s, n) memcpy(d, s, n)
#define KV_FENCE() ((void)0)
#endif

/* dst[0:n] = src[0:n]; the XXH3-64 (seed 0) of the bytes written. */
uint64_t KV_FN(copy_hash)(char *dst, const char *src, size_t n) {
    if (n < KV_NT_MIN) {
        memcpy(dst, src, n);
        return XXH3_64bits(dst, n);
    }
    XXH3_state_t state;
    _Alignas(64) char bounce[KV_CHUNK];
    XXH3_64bits_reset(&state);
    for (size_t at = 0; at < n; at += KV_CHUNK) {
        size_t m = n - at < KV_CHUNK ? n - at : KV_CHUNK;
        memcpy(bounce, src + at, m);
        XXH3_64bits_update(&state, bounce, m);
        KV_STREAM(dst + at, bounce, m);
    }
    KV_FENCE(); /* the stores are visible before the caller tells anyone (a COMMIT, a reply) */
    return XXH3_64bits_digest(&state);
}

/* dst[0:n] = src[0:n]. */
void KV_FN(copy)(char *dst, const char *src, size_t n) {
    if (n < KV_NT_MIN) {
        memcpy(dst, src, n);
        return;
    }
    KV_STREAM(dst, src, n);
    KV_FENCE();
}

/* The XXH3-64 (seed 0) of src[0:n]. */
uint64_t KV_FN(hash)(const char *src, size_t n) {
    return XXH3_64bits(src, n);
}
