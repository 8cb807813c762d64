/* kvpool.core._native.commit_columns: a same-node COMMIT's metadata read, its slots claimed and its
 * blocks hashed in one call (the worker's `RequestHandlers._commit`, twice for each put of 64 blocks of
 * 16 KiB: its Python took ~25 us a request to read the columns, cap the versions, claim the slots and
 * compare the checksums).
 *
 * commit_columns(meta, max_batch, max_key, ceiling, reserved, arena, check)
 *     -> (keys, offsets, sizes, checksums, versions, corrupt) | None
 *     meta: a COMMIT's batch (protocol.pack_batch): a u32 count n, n u16 key lengths, the keys, then n
 *     int64 offsets, n int64 sizes, n uint64 checksums and n uint64 versions, little-endian. The columns
 *     come back as lists of ints, each version above `ceiling` brought down to it (versions.capped;
 *     OverflowError for a ceiling outside 0..2**64-1). The metadata is read from a private copy.
 *     Each offset is popped from `reserved` (a dict offset -> size, the connection's reserved slots),
 *     which must hold it with that size. With `check`, each slot of `arena` is hashed (XXH3-64, the GIL
 *     let go) and `corrupt` lists the indices whose hash is not the checksum sent (else it is empty).
 *     None, `reserved` left as it was (the very values taken put back), for anything else: more than
 *     max_batch items, a key length outside 1..max_key, metadata of another length, a slot not reserved
 *     as named (not this connection's, of another size, named twice), a slot outside the arena; the
 *     caller's Python path then says what is wrong. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "batch_keys.h"
#include "slots.h"

uint64_t kv_hash(const char *src, size_t n);

static uint64_t u64_at(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* (little-endian hosts only: x86-64, aarch64) */
    return v;
}

/* Puts the first `n` claimed slots back in `reserved` (offsets[i] -> held[i], the very values taken),
 * dropping this call's references to them; -1 if that failed. */
static int unclaim(PyObject *reserved, PyObject *offsets, PyObject **held, Py_ssize_t n) {
    int failed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!failed && PyDict_SetItem(reserved, PyList_GET_ITEM(offsets, i), held[i]) < 0)
            failed = 1;
        Py_CLEAR(held[i]);
    }
    return failed ? -1 : 0;
}

PyObject *kv_commit_columns(PyObject *self, PyObject *args) {
    Py_buffer meta, arena;
    Py_ssize_t max_batch, max_key;
    PyObject *ceiling_obj, *reserved;
    int check;
    if (!PyArg_ParseTuple(args, "y*nnOO!y*p:commit_columns", &meta, &max_batch, &max_key, &ceiling_obj,
                          &PyDict_Type, &reserved, &arena, &check))
        return NULL;
    PyObject *keys = NULL, *offs = NULL, *lens = NULL, *sums = NULL, *vers = NULL, *corrupt = NULL;
    PyObject *result = NULL;
    PyObject **held = NULL;
    unsigned char *bad = NULL, *m = NULL;
    Py_ssize_t claimed = 0, n = 0;
    unsigned long long ceiling = PyLong_AsUnsignedLongLong(ceiling_obj);
    if (ceiling == (unsigned long long)-1 && PyErr_Occurred())
        goto done;
    /* Everything below reads a private copy: `meta` may be a buffer another thread (or a finalizer run by
     * an allocation here) rewrites meanwhile. */
    if (meta.len < 4)
        goto fallback;
    if ((m = PyMem_Malloc((size_t)meta.len)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(m, meta.buf, (size_t)meta.len);
    n = (Py_ssize_t)(m[0] | (m[1] << 8) | (m[2] << 16) | ((uint32_t)m[3] << 24));
    if (n > max_batch || n > (meta.len - 4) / 2)
        goto fallback;
    Py_ssize_t bad_len = 0, at = kv_keys_end(m, n, 4, max_key, &bad_len);
    if (at < 0 || at > meta.len || (meta.len - at) / 32 != n || (meta.len - at) % 32)
        goto fallback;
    const unsigned char *cols = m + at; /* offsets, sizes, checksums, versions: n of each */
    for (Py_ssize_t i = 0; i < n; i++)
        if (!slot_inside((int64_t)u64_at(cols + 8 * i), (int64_t)u64_at(cols + 8 * (n + i)), arena.len))
            goto fallback;
    if ((keys = kv_key_list(m, meta.len, n, 4)) == NULL || (offs = PyList_New(n)) == NULL ||
        (lens = PyList_New(n)) == NULL || (sums = PyList_New(n)) == NULL || (vers = PyList_New(n)) == NULL ||
        (corrupt = PyList_New(0)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t version = u64_at(cols + 8 * (3 * n + i));
        PyObject *o = PyLong_FromLongLong((long long)u64_at(cols + 8 * i));
        PyObject *z = o == NULL ? NULL : PyLong_FromLongLong((long long)u64_at(cols + 8 * (n + i)));
        PyObject *c = z == NULL ? NULL : PyLong_FromUnsignedLongLong(u64_at(cols + 8 * (2 * n + i)));
        PyObject *v = c == NULL ? NULL : PyLong_FromUnsignedLongLong(version > ceiling ? ceiling : version);
        if (v == NULL) {
            Py_XDECREF(o);
            Py_XDECREF(z);
            Py_XDECREF(c);
            goto done;
        }
        PyList_SET_ITEM(offs, i, o);
        PyList_SET_ITEM(lens, i, z);
        PyList_SET_ITEM(sums, i, c);
        PyList_SET_ITEM(vers, i, v);
    }
    if ((held = PyMem_Calloc((size_t)n + 1, sizeof(PyObject *))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; claimed < n; claimed++) { /* each slot out of the connection's reserved ones, as named */
        PyObject *value = PyDict_GetItemWithError(reserved, PyList_GET_ITEM(offs, claimed));
        if (value == NULL) {
            if (PyErr_Occurred())
                goto undo;
            goto unclaim; /* not reserved (or named twice) */
        }
        Py_INCREF(value); /* (the comparison may run code that changes the dict) */
        int same = PyObject_RichCompareBool(value, PyList_GET_ITEM(lens, claimed), Py_EQ);
        if (same <= 0) {
            Py_DECREF(value);
            if (same < 0)
                goto undo;
            goto unclaim;
        }
        held[claimed] = value;
        if (PyDict_DelItem(reserved, PyList_GET_ITEM(offs, claimed)) < 0) {
            Py_CLEAR(held[claimed]); /* (not taken by this call: not given back) */
            goto undo;
        }
    }
    if (check && n) {
        if ((bad = PyMem_Calloc((size_t)n, 1)) == NULL) {
            PyErr_NoMemory();
            goto undo;
        }
        const char *base = arena.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t off = u64_at(cols + 8 * i), size = u64_at(cols + 8 * (n + i));
            bad[i] = kv_hash(base + off, (size_t)size) != u64_at(cols + 8 * (2 * n + i));
        }
        Py_END_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            if (!bad[i])
                continue;
            PyObject *index = PyLong_FromSsize_t(i);
            if (index == NULL || PyList_Append(corrupt, index) < 0) {
                Py_XDECREF(index);
                goto undo;
            }
            Py_DECREF(index);
        }
    }
    result = PyTuple_Pack(6, keys, offs, lens, sums, vers, corrupt);
    for (Py_ssize_t i = 0; i < claimed; i++)
        Py_CLEAR(held[i]);
    goto done;
unclaim:
    if (unclaim(reserved, offs, held, claimed) < 0)
        goto done;
fallback:
    result = Py_NewRef(Py_None);
    goto done;
undo: { /* an error (memory, a key's hash): the slots claimed go back, the error stays */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        unclaim(reserved, offs, held, claimed);
        PyErr_Restore(type, value, tb);
    }
done:
    PyMem_Free(bad);
    PyMem_Free(held);
    PyMem_Free(m);
    Py_XDECREF(keys);
    Py_XDECREF(offs);
    Py_XDECREF(lens);
    Py_XDECREF(sums);
    Py_XDECREF(vers);
    Py_XDECREF(corrupt);
    PyBuffer_Release(&meta);
    PyBuffer_Release(&arena);
    return result;
}
