/* A batch request's keys as protocol.pack_batch lays them out in its metadata: n little-endian u16
 * lengths from `pos` on, then the keys' bytes one after another. Shared by split_keys (batch_keys.c)
 * and commit_columns (batch_commit.c). */
#ifndef KV_BATCH_KEYS_H
#define KV_BATCH_KEYS_H
#include <Python.h>

/* The length of key i. */
static inline Py_ssize_t kv_key_len(const unsigned char *m, Py_ssize_t pos, Py_ssize_t i) {
    return m[pos + 2 * i] | (m[pos + 2 * i + 1] << 8);
}

/* The position after the last of the n keys, each length checked within 1..max_key: -1, with *bad
 * the first length outside, if one is. The caller has checked that the lengths lie within m, and
 * checks the position against m's length. */
static inline Py_ssize_t kv_keys_end(const unsigned char *m, Py_ssize_t n, Py_ssize_t pos, Py_ssize_t max_key,
                                     Py_ssize_t *bad) {
    Py_ssize_t at = pos + 2 * n; /* the first key's bytes */
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len = kv_key_len(m, pos, i);
        if (len == 0 || len > max_key) {
            *bad = len;
            return -1;
        }
        at += len;
    }
    return at;
}

/* The n keys as a list of bytes, read from m (`size` bytes) again: NULL, with ValueError, where they
 * now run past its end (a buffer rewritten since kv_keys_end, by code an allocation here ran), or with
 * the allocation's error. */
static inline PyObject *kv_key_list(const unsigned char *m, Py_ssize_t size, Py_ssize_t n, Py_ssize_t pos) {
    PyObject *keys = PyList_New(n);
    Py_ssize_t at = pos + 2 * n;
    for (Py_ssize_t i = 0; keys != NULL && i < n; i++) {
        Py_ssize_t len = kv_key_len(m, pos, i);
        PyObject *key = at + len <= size ? PyBytes_FromStringAndSize((const char *)m + at, len) : NULL;
        if (key == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "the keys run past the end of the metadata");
            Py_CLEAR(keys);
            break;
        }
        PyList_SET_ITEM(keys, i, key);
        at += len;
    }
    return keys;
}
#endif
