/* The copy kernels, compiled once per instruction set: kernel_base.c (what the compiler targets by
 * default) and, on x86-64 with GCC, kernel_avx2.c (the same code under target("avx2"), where
 * xxHash's XXH3 takes its AVX2 path). The includer defines KV_FN(name), the suffix of its functions.
 *
 * A block is copied in chunks through a bounce buffer that stays in L1: each chunk is read once from
 * the source, hashed there and written to the destination with non-temporal stores; with AVX2 and a
 * destination aligned on 16 bytes, a stripe of 64 bytes at a time through the registers instead
 * (copy_hash_fused). The checksum is therefore of exactly the bytes written, even if the source changes
 * meanwhile (a slot of a shared arena that another process reuses), and a copy of megabytes neither
 * reads the destination first nor evicts the caller's working set from the caches. Copies under KV_NT_MIN bytes are plain memcpy (and a
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

#if defined(__AVX2__)
#include <immintrin.h>

/* One XXH3 accumulation step (XXH3_accumulate_512_avx2's, for one of a stripe's two halves) on data
 * already in a register: the bytes the caller stores are the bytes hashed. */
static inline __m256i KV_FN(acc_step)(__m256i acc, __m256i data, const uint8_t *secret) {
    __m256i const key = _mm256_loadu_si256((const __m256i *)secret);
    __m256i const data_key = _mm256_xor_si256(data, key);
    __m256i const product = _mm256_mul_epu32(data_key, _mm256_srli_epi64(data_key, 32));
    __m256i const swapped = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
    return _mm256_add_epi64(product, _mm256_add_epi64(acc, swapped));
}

/* The first `count` stripes of 64 bytes of a block from src to dst (16-byte aligned), streamed past the
 * caches, each accumulated (with its stripe's secret) as it passes through the registers. */
static inline void KV_FN(stripes)(__m256i acc[2], char *dst, const char *src, size_t count) {
    for (size_t i = 0; i < count; i++, src += 64, dst += 64) {
        __m256i const lo = _mm256_loadu_si256((const __m256i *)src);
        __m256i const hi = _mm256_loadu_si256((const __m256i *)(src + 32));
        _mm_stream_si128((__m128i *)dst, _mm256_castsi256_si128(lo));
        _mm_stream_si128((__m128i *)(dst + 16), _mm256_extracti128_si256(lo, 1));
        _mm_stream_si128((__m128i *)(dst + 32), _mm256_castsi256_si128(hi));
        _mm_stream_si128((__m128i *)(dst + 48), _mm256_extracti128_si256(hi, 1));
        const uint8_t *secret = XXH3_kSecret + 8 * i;
        acc[0] = KV_FN(acc_step)(acc[0], lo, secret);
        acc[1] = KV_FN(acc_step)(acc[1], hi, secret + 32);
    }
}

/* XXH3_scrambleAcc_avx2 on the two halves of the accumulator. */
static inline void KV_FN(scramble)(__m256i acc[2]) {
    __m256i const prime32 = _mm256_set1_epi32((int)XXH_PRIME32_1);
    for (int i = 0; i < 2; i++) {
        __m256i const key = _mm256_loadu_si256((const __m256i *)(XXH3_kSecret + XXH_SECRET_DEFAULT_SIZE - 64 + 32 * i));
        __m256i const data_key = _mm256_xor_si256(_mm256_xor_si256(acc[i], _mm256_srli_epi64(acc[i], 47)), key);
        __m256i const prod_lo = _mm256_mul_epu32(data_key, prime32);
        __m256i const prod_hi = _mm256_mul_epu32(_mm256_srli_epi64(data_key, 32), prime32);
        acc[i] = _mm256_add_epi64(prod_lo, _mm256_slli_epi64(prod_hi, 32));
    }
}

/* copy_hash of n > 240 bytes to a 16-byte aligned dst in one pass: each 64-byte stripe is loaded once,
 * streamed to dst and accumulated from the same registers (XXH3_hashLong_64b with the default secret,
 * stripe for stripe), where the bounce buffer's way reads each byte three times more and hashes a chunk
 * only after copying it (1 MiB blocks into shared memory: 0.88-0.91 of numpy's copy -> 1.02-1.05).
 * The last 64-127 bytes go through a small buffer: XXH3's last stripe overlaps the stripes before it,
 * and is hashed from the bytes that buffer then writes over them. */
static uint64_t KV_FN(copy_hash_fused)(char *dst, const char *src, size_t n) {
    enum { STRIPES = (XXH_SECRET_DEFAULT_SIZE - 64) / 8, BLOCK = 64 * STRIPES };
    XXH_ALIGN(32) uint64_t init[8] = XXH3_INIT_ACC;
    __m256i acc[2] = {_mm256_load_si256((const __m256i *)init), _mm256_load_si256((const __m256i *)(init + 4))};
    size_t const blocks = (n - 1) / BLOCK; /* full blocks, each scrambled after; then 1..BLOCK bytes */
    for (size_t b = 0; b < blocks; b++) {
        KV_FN(stripes)(acc, dst + b * BLOCK, src + b * BLOCK, STRIPES);
        KV_FN(scramble)(acc);
    }
    size_t const base = blocks * BLOCK;
    size_t const partial = (n - 1 - base) / 64;                       /* the last block's stripes */
    size_t const direct = n - base > 64 ? (n - base - 64) / 64 : 0;  /* those that end by n - 64 */
    KV_FN(stripes)(acc, dst + base, src + base, direct);
    size_t const tail = n - 64 < base + 64 * direct ? n - 64 : base + 64 * direct;
    size_t const rest = n - tail; /* 64..127 bytes: the last block's other stripe, if any, and the last */
    _Alignas(32) char last[128];
    memcpy(last, src + tail, rest);
    for (size_t i = direct; i < partial; i++) {
        const char *p = last + (base + 64 * i - tail);
        acc[0] = KV_FN(acc_step)(acc[0], _mm256_loadu_si256((const __m256i *)p), XXH3_kSecret + 8 * i);
        acc[1] = KV_FN(acc_step)(acc[1], _mm256_loadu_si256((const __m256i *)(p + 32)), XXH3_kSecret + 8 * i + 32);
    }
    const uint8_t *secret = XXH3_kSecret + XXH_SECRET_DEFAULT_SIZE - 64 - 7; /* XXH_SECRET_LASTACC_START */
    acc[0] = KV_FN(acc_step)(acc[0], _mm256_loadu_si256((const __m256i *)(last + rest - 64)), secret);
    acc[1] = KV_FN(acc_step)(acc[1], _mm256_loadu_si256((const __m256i *)(last + rest - 32)), secret + 32);
    _mm_sfence(); /* the streamed stores land before the plain ones that may write over their end */
    memcpy(dst + tail, last, rest);
    XXH_ALIGN(32) uint64_t out[8];
    _mm256_store_si256((__m256i *)out, acc[0]);
    _mm256_store_si256((__m256i *)(out + 4), acc[1]);
    return XXH3_mergeAccs(out, XXH3_kSecret + 11, (uint64_t)n * XXH_PRIME64_1); /* XXH_SECRET_MERGEACCS_START */
}
#endif

/* dst[0:n] = src[0:n]; the XXH3-64 (seed 0) of the bytes written. */
uint64_t KV_FN(copy_hash)(char *dst, const char *src, size_t n) {
    if (n < KV_NT_MIN) {
        memcpy(dst, src, n);
        return XXH3_64bits(dst, n);
    }
#if defined(__AVX2__)
    if (!((uintptr_t)dst & 15))
        return KV_FN(copy_hash_fused)(dst, src, n); /* (fenced there, before its last plain stores) */
#endif
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
