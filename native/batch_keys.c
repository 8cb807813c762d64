/* kvpool.core._native.split_keys: a batch's keys cut out of its frame's metadata in one pass (protocol's
 * unpack_batch, on every batch request a worker serves: numpy's cut of 64 keys cost a worker 7-12 us an
 * ALLOC, more where the keys' lengths differ).
 *
 * split_keys(meta, n, pos, max_key) -> (keys, end) | (None, length)
 *     meta holds n little-endian u16 key lengths from pos on, then the keys' bytes one after another:
 *     the keys (bytes) and the position after the last. (None, length) for the first length outside
 *     1..max_key; ValueError where meta ends before the lengths or the keys do. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "batch_keys.h"

PyObject *kv_split_keys(PyObject *self, PyObject *args) {
    Py_buffer meta;
    Py_ssize_t n, pos, max_key;
    if (!PyArg_ParseTuple(args, "y*nnn:split_keys", &meta, &n, &pos, &max_key))
        return NULL;
    PyObject *keys = NULL, *result = NULL;
    const unsigned char *m = meta.buf;
    if (n < 0 || pos < 0 || pos > meta.len || n > (meta.len - pos) / 2) {
        PyErr_SetString(PyExc_ValueError, "split_keys: the key lengths run past the end of the metadata");
        goto done;
    }
    Py_ssize_t bad = 0, at = kv_keys_end(m, n, pos, max_key, &bad);
    if (at < 0) {
        result = Py_BuildValue("(On)", Py_None, bad);
        goto done;
    }
    if (at > meta.len) {
        PyErr_SetString(PyExc_ValueError, "split_keys: the keys run past the end of the metadata");
        goto done;
    }
    if ((keys = kv_key_list(m, meta.len, n, pos)) == NULL)
        goto done;
    result = Py_BuildValue("(On)", keys, at);
done:
    Py_XDECREF(keys);
    PyBuffer_Release(&meta);
    return result;
}
