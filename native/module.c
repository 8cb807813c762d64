/* kvpool.core._native: block copies that hash what they write, for the same-node hot paths.
 *
 * copy_hash(dst, src) -> int   dst[:] = src; the XXH3-64 of the bytes written (xxhash.xxh3_64_intdigest)
 * copy(dst, src)               dst[:] = src
 * simd() -> str                the kernels in use: "avx2" or "base"
 * hash_at(out, buf, offsets, sizes)   out[i] = the XXH3-64 of buf[offsets[i]:offsets[i] + sizes[i]], without
 *                              the GIL (out: uint64s; offsets, sizes: int64s; ValueError out of bounds)
 * advise(buf, advice)          madvise(2) of a mapping's page-aligned slice, without the GIL (OSError)
 * resident(buf) -> bool        whether every page of a mapping's page-aligned slice has its memory (mincore(2))
 * copy_from(dsts, src, offsets, sizes) -> int   dsts[i][:sizes[i]] = src[offsets[i]:offsets[i] + sizes[i]] in
 *                              order, for each i whose offset is >= 0 (a miss: skipped); -1, or the index of
 *                              the first destination shorter than its size (it and those after it untouched)
 * copy_into(out, dst, offsets, srcs)   dst[offsets[i]:offsets[i] + len(srcs[i])] = srcs[i] in order, out[i] the
 *                              XXH3-64 of the bytes written (out: uint64s; offsets: int64s; ValueError for a
 *                              slot outside dst, which stops the copies there)
 *
 * slot_span, writable_all     a same-node read's checks of a batch (batch_checks.c)
 * readable_views(buffers)      a batch's flat byte buffers as memoryviews, or None (batch_checks.c)
 * DramBlock                    the DRAM tier's index entry, untracked by the cyclic GC (dram_block.c)
 * block_columns(blocks) -> bytes   DramBlocks' offsets, sizes, checksums and versions as a LEASE reply's columns
 * new_blocks, index_many       the DRAM tier's index work of a batch of blocks, in one pass (dram_index.c)
 * split_keys(meta, n, pos, max_key)   a batch request's keys cut out of its metadata (batch_keys.c)
 * commit_columns(...)          a same-node COMMIT's columns read, slots claimed, blocks hashed (batch_commit.c)
 * spin_readable(fd, spin_us) -> bool   whether a socket has something to read within spin_us, without sleeping (spin.c)
 *
 * dst: a writable, src: a readable C-contiguous buffer of the same length. See kernel.h for how a copy
 * is made. copy, copy_hash, copy_from and copy_into hold the GIL throughout, as a memoryview slice assignment
 * does (a copy returns to its caller at once, not after another thread's switch interval); the others
 * let it go while they work, each holding its buffers exported. Python falls back to the same results
 * without this module (kvpool.core.fastcopy; kvpool.core.arena_pages readies nothing in the background). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "slots.h"

int kv_add_dram_block(PyObject *module);
PyObject *kv_block_columns(PyObject *self, PyObject *blocks);
PyObject *kv_new_blocks(PyObject *self, PyObject *args);
PyObject *kv_index_many(PyObject *self, PyObject *args);
PyObject *kv_split_keys(PyObject *self, PyObject *args);
PyObject *kv_commit_columns(PyObject *self, PyObject *args);
PyObject *kv_slot_span(PyObject *self, PyObject *args);
PyObject *kv_writable_all(PyObject *self, PyObject *buffers);
PyObject *kv_readable_views(PyObject *self, PyObject *buffers);
PyObject *kv_spin_readable(PyObject *self, PyObject *args);
uint64_t kv_copy_hash_base(char *dst, const char *src, size_t n);
void kv_copy_base(char *dst, const char *src, size_t n);
uint64_t kv_hash_base(const char *src, size_t n);

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__)
#define KV_AVX2_BUILT 1
uint64_t kv_copy_hash_avx2(char *dst, const char *src, size_t n);
void kv_copy_avx2(char *dst, const char *src, size_t n);
uint64_t kv_hash_avx2(const char *src, size_t n);
#endif

static uint64_t (*copy_hash_fn)(char *, const char *, size_t) = kv_copy_hash_base;
static void (*copy_fn)(char *, const char *, size_t) = kv_copy_base;
static uint64_t (*hash_fn)(const char *, size_t) = kv_hash_base;
static const char *simd_name = "base";

/* The XXH3-64 of n bytes at src, by the kernels in use (batch_commit.c's). */
uint64_t kv_hash(const char *src, size_t n) {
    return hash_fn(src, n);
}

/* Whether n bytes at d and at s overlap (the kernels read a chunk before writing it, but in ascending
 * order only: an overlapping copy is memmove's job). */
static int overlaps(const void *d, const void *s, size_t n) {
    uintptr_t a = (uintptr_t)d, b = (uintptr_t)s;
    return n && a < b + n && b < a + n;
}

/* dst[0:n] = src[0:n], whether or not they overlap. */
static void copy_any(char *dst, const char *src, size_t n) {
    if (overlaps(dst, src, n))
        memmove(dst, src, n);
    else
        copy_fn(dst, src, n);
}

/* dst[0:n] = src[0:n], whether or not they overlap; the XXH3-64 of the bytes written. */
static uint64_t copy_hash_any(char *dst, const char *src, size_t n) {
    if (!overlaps(dst, src, n))
        return copy_hash_fn(dst, src, n);
    memmove(dst, src, n);
    return hash_fn(dst, n);
}

/* Parses (dst, src); -1 with an exception set (and nothing held) if they are not a writable and a
 * readable buffer of the same length, else 0. */
static int pair(PyObject *args, const char *fmt, Py_buffer *dst, Py_buffer *src) {
    if (!PyArg_ParseTuple(args, fmt, dst, src))
        return -1;
    if (dst->len != src->len) {
        PyErr_Format(PyExc_ValueError, "destination of %zd bytes for a source of %zd", dst->len, src->len);
        PyBuffer_Release(dst);
        PyBuffer_Release(src);
        return -1;
    }
    return 0;
}

static PyObject *py_copy_hash(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    if (pair(args, "w*y*:copy_hash", &dst, &src) < 0)
        return NULL;
    uint64_t h = copy_hash_any((char *)dst.buf, (const char *)src.buf, (size_t)src.len);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *py_copy(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    if (pair(args, "w*y*:copy", &dst, &src) < 0)
        return NULL;
    copy_any((char *)dst.buf, (const char *)src.buf, (size_t)src.len);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyObject *py_hash_at(PyObject *self, PyObject *args) {
    Py_buffer out, buf, offs, sizes;
    if (!PyArg_ParseTuple(args, "w*y*y*y*:hash_at", &out, &buf, &offs, &sizes))
        return NULL;
    Py_ssize_t n = offs.len / 8;
    const char *err = NULL;
    if (offs.len % 8 || sizes.len != offs.len || out.len != offs.len)
        err = "hash_at wants uint64 out, int64 offsets and int64 sizes of one length";
    const int64_t *o = (const int64_t *)offs.buf, *z = (const int64_t *)sizes.buf;
    for (Py_ssize_t i = 0; !err && i < n; i++) /* (memcpy: a buffer's int64s need not be aligned) */ {
        int64_t a, b;
        memcpy(&a, o + i, 8);
        memcpy(&b, z + i, 8);
        if (!slot_inside(a, b, buf.len))
            err = "a slot outside the buffer";
    }
    if (!err) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t a, b;
            memcpy(&a, o + i, 8);
            memcpy(&b, z + i, 8);
            uint64_t h = hash_fn((const char *)buf.buf + a, (size_t)b);
            memcpy((char *)out.buf + 8 * i, &h, 8);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&buf);
    PyBuffer_Release(&offs);
    PyBuffer_Release(&sizes);
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* A same-node reader's batch out of the arena in one call: per block, no Python slices and calls. */
static PyObject *py_copy_from(PyObject *self, PyObject *args) {
    PyObject *dsts, *seq;
    Py_buffer src, offs, sizes;
    if (!PyArg_ParseTuple(args, "Oy*y*y*:copy_from", &dsts, &src, &offs, &sizes))
        return NULL;
    Py_ssize_t n = offs.len / 8, first_short = -1;
    const char *err = NULL;
    const int64_t *o = (const int64_t *)offs.buf, *z = (const int64_t *)sizes.buf;
    seq = PySequence_Fast(dsts, "copy_from wants a sequence of destination buffers");
    if (seq == NULL)
        goto done;
    if (offs.len % 8 || sizes.len != offs.len || PySequence_Fast_GET_SIZE(seq) != n)
        err = "copy_from wants as many destinations as int64 offsets and int64 sizes";
    for (Py_ssize_t i = 0; !err && i < n; i++) {
        int64_t a, b;
        memcpy(&a, o + i, 8);
        memcpy(&b, z + i, 8);
        if (a < 0)
            continue;
        if (!slot_inside(a, b, src.len)) {
            err = "a slot outside the source";
            break;
        }
        Py_buffer d;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &d, PyBUF_WRITABLE) < 0)
            break;
        if (d.len < b) {
            PyBuffer_Release(&d);
            first_short = i;
            break;
        }
        copy_any((char *)d.buf, (const char *)src.buf + a, (size_t)b);
        PyBuffer_Release(&d);
    }
    Py_DECREF(seq);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&offs);
    PyBuffer_Release(&sizes);
    if (err)
        PyErr_SetString(PyExc_ValueError, err);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(first_short);
}

/* A same-node writer's part into the arena in one call: per block, no Python slices and calls. */
static PyObject *py_copy_into(PyObject *self, PyObject *args) {
    PyObject *srcs, *seq;
    Py_buffer out, dst, offs;
    if (!PyArg_ParseTuple(args, "w*w*y*O:copy_into", &out, &dst, &offs, &srcs))
        return NULL;
    Py_ssize_t n = offs.len / 8;
    const char *err = NULL;
    const int64_t *o = (const int64_t *)offs.buf;
    seq = PySequence_Fast(srcs, "copy_into wants a sequence of source buffers");
    if (seq == NULL)
        goto done;
    if (offs.len % 8 || out.len != offs.len || PySequence_Fast_GET_SIZE(seq) != n)
        err = "copy_into wants as many sources as int64 offsets and uint64 outputs";
    for (Py_ssize_t i = 0; !err && i < n; i++) {
        int64_t a;
        memcpy(&a, o + i, 8);
        Py_buffer s;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &s, PyBUF_C_CONTIGUOUS) < 0)
            break;
        if (!slot_inside(a, s.len, dst.len)) {
            PyBuffer_Release(&s);
            err = "a slot outside the destination";
            break;
        }
        uint64_t h = copy_hash_any((char *)dst.buf + a, (const char *)s.buf, (size_t)s.len);
        memcpy((char *)out.buf + 8 * i, &h, 8);
        PyBuffer_Release(&s);
    }
    Py_DECREF(seq);
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&offs);
    if (err)
        PyErr_SetString(PyExc_ValueError, err);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* The GIL is let go during the call: populating a region's page tables (MADV_POPULATE_*) takes a
 * fraction of a millisecond per MiB, and a client readies its whole mapping from a thread of its own
 * (kvpool.core.arena_pages). The buffer stays exported throughout, so the mapping cannot be closed. */
static PyObject *py_advise(PyObject *self, PyObject *args) {
    Py_buffer buf;
    int advice, rc, err = 0;
    if (!PyArg_ParseTuple(args, "y*i:advise", &buf, &advice))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = madvise(buf.buf, (size_t)buf.len, advice);
    if (rc)
        err = errno;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    if (rc) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/* Whether the memory behind every page of `buf` exists (for a shared-memory mapping: the object's pages
 * are allocated, whether or not this process has mapped them yet). Readying a region whose memory does
 * not exist would allocate it: a worker that does not prefault its arena keeps the memory it never used. */
static PyObject *py_resident(PyObject *self, PyObject *args) {
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "y*:resident", &buf))
        return NULL;
    long page = sysconf(_SC_PAGESIZE);
    size_t pages = ((size_t)buf.len + (size_t)page - 1) / (size_t)page;
    unsigned char *vec = PyMem_RawMalloc(pages ? pages : 1);
    if (vec == NULL) {
        PyBuffer_Release(&buf);
        return PyErr_NoMemory();
    }
    int rc, err = 0, all = 1;
    Py_BEGIN_ALLOW_THREADS
    rc = mincore(buf.buf, (size_t)buf.len, (void *)vec);
    if (rc)
        err = errno;
    for (size_t i = 0; !rc && i < pages && all; i++)
        all = vec[i] & 1;
    Py_END_ALLOW_THREADS
    PyMem_RawFree(vec);
    PyBuffer_Release(&buf);
    if (rc) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(all);
}

static PyObject *py_simd(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(simd_name);
}

static PyMethodDef methods[] = {
    {"copy_hash", py_copy_hash, METH_VARARGS, "copy_hash(dst, src) -> int: dst[:] = src; the XXH3-64 of the bytes written"},
    {"copy", py_copy, METH_VARARGS, "copy(dst, src): dst[:] = src"},
    {"hash_at", py_hash_at, METH_VARARGS, "hash_at(out, buf, offsets, sizes): out[i] = XXH3-64 of buf[offsets[i]:][:sizes[i]]"},
    {"copy_from", py_copy_from, METH_VARARGS, "copy_from(dsts, src, offsets, sizes) -> int: dsts[i][:sizes[i]] = src[offsets[i]:][:sizes[i]]; -1, or the first too short"},
    {"copy_into", py_copy_into, METH_VARARGS, "copy_into(out, dst, offsets, srcs): dst[offsets[i]:][:len(srcs[i])] = srcs[i]; out[i] its XXH3-64"},
    {"advise", py_advise, METH_VARARGS, "advise(buf, advice): madvise(2) of buf (page-aligned), without the GIL"},
    {"resident", py_resident, METH_VARARGS, "resident(buf) -> bool: whether every page of buf (page-aligned) has its memory"},
    {"block_columns", kv_block_columns, METH_O, "block_columns(blocks) -> bytes: the DramBlocks' offsets, sizes (int64), checksums, versions (uint64), column after column"},
    {"new_blocks", kv_new_blocks, METH_VARARGS, "new_blocks(keys, offsets, sizes, checksums, versions, checked) -> list[DramBlock]: a block per key, as committed together"},
    {"index_many", kv_index_many, METH_VARARGS, "index_many(blocks, by_slab, order, new, phase, slab_size) -> (stored, free, unlinked, timed) | None: DramTier.insert_many's index work in one pass"},
    {"commit_columns", kv_commit_columns, METH_VARARGS, "commit_columns(meta, max_batch, max_key, ceiling, reserved, arena, check) -> (keys, offsets, sizes, checksums, versions, corrupt) | None: a same-node COMMIT's columns read, its slots claimed, its blocks hashed"},
    {"split_keys", kv_split_keys, METH_VARARGS, "split_keys(meta, n, pos, max_key) -> (keys, end) | (None, bad length): a batch's keys cut out of its metadata"},
    {"slot_span", kv_slot_span, METH_VARARGS, "slot_span(offsets, sizes, limit) -> (low, high) | None: the span of the slots named (offset >= 0), each checked within [0, limit)"},
    {"readable_views", kv_readable_views, METH_O, "readable_views(buffers) -> list[memoryview] | None: a view of each where every one is a flat buffer of bytes"},
    {"writable_all", kv_writable_all, METH_O, "writable_all(buffers) -> bool: whether each exports a writable C-contiguous buffer"},
    {"spin_readable", kv_spin_readable, METH_VARARGS, "spin_readable(fd, spin_us) -> bool: whether fd has something to read within spin_us microseconds, asked without sleeping (the GIL let go)"},
    {"simd", py_simd, METH_NOARGS, "simd() -> str: the kernels in use (avx2 or base)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvpool.core._native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
#ifdef KV_AVX2_BUILT
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        copy_hash_fn = kv_copy_hash_avx2;
        copy_fn = kv_copy_avx2;
        hash_fn = kv_hash_avx2;
        simd_name = "avx2";
    }
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && kv_add_dram_block(m) < 0)
        Py_CLEAR(m);
    return m;
}
