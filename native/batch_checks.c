/* kvpool.core._native: the checks a same-node read makes of each batch before a byte moves, in one pass
 * each instead of a Python or numpy call per check (a get of 64 blocks of 16 KiB made ~10 such calls; a
 * loop of such gets went ~23 -> ~21 ms per 64 MiB without them: docs/BENCHMARKS.md, run AO).
 *
 * slot_span(offsets, sizes, limit) -> (low, high) | None
 *     offsets and sizes: int64 buffers of one length; an offset < 0 is a miss and names no slot. Every
 *     other slot must lie within [0, limit): ValueError otherwise. The lowest offset and the highest end
 *     of the slots named; None if there are none.
 * writable_all(buffers) -> bool
 *     Whether every item of the sequence exports a writable, C-contiguous buffer (what copy_from writes
 *     into: numpy arrays of any dtype, bytearrays, writable memoryviews, mmaps); False, with no error
 *     set, at the first that does not (bytes, a torch tensor, a strided view).
 * readable_views(buffers) -> list[memoryview] | None
 *     A memoryview of each item where every one exports a flat buffer of bytes (format "B", one
 *     dimension, contiguous: bytes, bytearrays, uint8 numpy rows): what buffers.readable makes of such
 *     a one, for a batch in one call (a put of 64 numpy rows spent ~25 us on them one by one). None, with
 *     no error set, at the first that does not: the Python path takes the batch. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "slots.h"

PyObject *kv_slot_span(PyObject *self, PyObject *args) {
    Py_buffer offs, sizes;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "y*y*n:slot_span", &offs, &sizes, &limit))
        return NULL;
    const char *err = NULL;
    Py_ssize_t n = offs.len / 8;
    int64_t low = INT64_MAX, high = -1;
    if (offs.len % 8 || sizes.len != offs.len)
        err = "slot_span wants int64 offsets and int64 sizes of one length";
    for (Py_ssize_t i = 0; !err && i < n; i++) {
        int64_t a, b; /* (memcpy: a buffer's int64s need not be aligned) */
        memcpy(&a, (const char *)offs.buf + 8 * i, 8);
        memcpy(&b, (const char *)sizes.buf + 8 * i, 8);
        if (a < 0)
            continue;
        if (!slot_inside(a, b, limit)) {
            err = "a slot outside the mapping";
            break;
        }
        if (a < low)
            low = a;
        if (a + b > high)
            high = a + b;
    }
    PyBuffer_Release(&offs);
    PyBuffer_Release(&sizes);
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    if (high < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(LL)", (long long)low, (long long)high);
}

PyObject *kv_writable_all(PyObject *self, PyObject *buffers) {
    PyObject *seq = PySequence_Fast(buffers, "writable_all wants a sequence of buffers");
    if (seq == NULL)
        return NULL;
    int all = 1;
    /* (the size read again at each item, and the item held: code run meanwhile may change a list) */
    for (Py_ssize_t i = 0; all && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(item);
        Py_buffer b;
        if (PyObject_GetBuffer(item, &b, PyBUF_WRITABLE) < 0) {
            PyErr_Clear();
            all = 0;
        } else {
            PyBuffer_Release(&b);
        }
        Py_DECREF(item);
    }
    Py_DECREF(seq);
    return PyBool_FromLong(all);
}

PyObject *kv_readable_views(PyObject *self, PyObject *buffers) {
    PyObject *seq = PySequence_Fast(buffers, "readable_views wants a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        /* (a list changed by code run meanwhile, a finalizer of an allocation here: the Python path) */
        if (PySequence_Fast_GET_SIZE(seq) != n) {
            Py_CLEAR(out);
            break;
        }
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(item);
        PyObject *mv = PyMemoryView_FromObject(item);
        Py_DECREF(item);
        if (mv == NULL) {
            PyErr_Clear(); /* not a buffer: the Python path says what it is */
            Py_CLEAR(out);
            break;
        }
        const Py_buffer *b = PyMemoryView_GET_BUFFER(mv);
        if (b->ndim != 1 || (b->format != NULL && strcmp(b->format, "B") != 0) ||
            (b->strides != NULL && b->strides[0] != 1)) {
            Py_DECREF(mv);
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, mv);
    }
    if (out != NULL && PySequence_Fast_GET_SIZE(seq) != n)
        Py_CLEAR(out);
    Py_DECREF(seq);
    if (out == NULL && !PyErr_Occurred())
        Py_RETURN_NONE;
    return out;
}
