/* kvpool.core._native.DramBlock: the DRAM tier's index entry (kvpool.core.tiers.dram_tier.DramBlock) as a
 * type the cyclic garbage collector does not track.
 *
 * A worker holds one entry per block in DRAM: millions of them. As Python objects of a class they are
 * all tracked, and each full collection walks every one: 0.22-0.29 s per million on this project's test
 * machine, with the GIL held, so a worker of a few million blocks stops serving for a second now and
 * then (and a cluster worker's stall watch takes that for a pause and fences its reads). An entry
 * holds only its key, an exact bytes object, and numbers: it can be part of no reference cycle, so it
 * needs no tracking, and its refcount frees it as before. Its fields are object members, as a
 * dataclass's slots are (so the interpreter reads and writes them as fast), made of exact types from
 * the arguments: key bytes, offset, size, checksum, leases and version ints, expires a float, the flags
 * bools. key, size, checksum and expires are read-only (nothing changes them after a block is made);
 * the others take ints and bools only (block_setattro).
 *
 * Fields, as the Python dataclass that stands in for it where no C compiler built this module:
 *   key, offset, size, checksum, expires (unix seconds; 0 never), leases, pinned, live, on_ssd, version,
 *   checked
 * DramBlock(key, offset, size, checksum, expires, leases=0, pinned=False, live=True, on_ssd=False,
 *           version=0, checked=True); expired(now) -> bool. Equality and hashing are by identity. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "block_columns writes the wire's little-endian columns with the host's byte order"
#endif

#include "dram_block.h"

#define N_FIELDS 11

/* Each argument as the field holds it: a new reference, NULL with an exception set. */
static PyObject *as_int(PyObject *o) {
    return PyNumber_Index(o);  /* always an exact int since Python 3.10 */
}

static PyObject *as_float(PyObject *o) {
    if (PyFloat_CheckExact(o)) {
        Py_INCREF(o);
        return o;
    }
    double d = PyFloat_AsDouble(o);
    return (d == -1.0 && PyErr_Occurred()) ? NULL : PyFloat_FromDouble(d);
}

static PyObject *as_bool(PyObject *o) {
    int t = PyObject_IsTrue(o);
    return t < 0 ? NULL : PyBool_FromLong(t);
}

static PyObject *block_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"key", "offset", "size", "checksum", "expires", "leases", "pinned", "live",
                            "on_ssd", "version", "checked", NULL};
    PyObject *arg[N_FIELDS] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO|OOOOOO:DramBlock", names, &arg[0], &arg[1], &arg[2],
                                     &arg[3], &arg[4], &arg[5], &arg[6], &arg[7], &arg[8], &arg[9], &arg[10]))
        return NULL;
    if (!PyBytes_CheckExact(arg[0])) {  /* a subclass could carry attributes, and with them a cycle */
        PyErr_Format(PyExc_TypeError, "DramBlock key must be bytes, not %.100s", Py_TYPE(arg[0])->tp_name);
        return NULL;
    }
    DramBlock *b = (DramBlock *)type->tp_alloc(type, 0);
    if (b == NULL)
        return NULL;
    Py_INCREF(arg[0]);
    b->key = arg[0];
    if (!(b->offset = as_int(arg[1])) || !(b->size = as_int(arg[2])) || !(b->checksum = as_int(arg[3]))
        || !(b->expires = as_float(arg[4])) || !(b->leases = arg[5] ? as_int(arg[5]) : PyLong_FromLong(0))
        || !(b->pinned = arg[6] ? as_bool(arg[6]) : PyBool_FromLong(0))
        || !(b->live = arg[7] ? as_bool(arg[7]) : PyBool_FromLong(1))
        || !(b->on_ssd = arg[8] ? as_bool(arg[8]) : PyBool_FromLong(0))
        || !(b->version = arg[9] ? as_int(arg[9]) : PyLong_FromLong(0))
        || !(b->checked = arg[10] ? as_bool(arg[10]) : PyBool_FromLong(1))) {
        Py_DECREF(b);
        return NULL;
    }
    return (PyObject *)b;
}

static void block_dealloc(DramBlock *b) {
    PyObject **field = &b->key;
    for (int i = 0; i < N_FIELDS; i++)
        Py_XDECREF(field[i]);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static PyObject *block_repr(DramBlock *b) {
    return PyUnicode_FromFormat("DramBlock(key=%R, offset=%R, size=%R, version=%R, leases=%R, live=%R)",
                                b->key, b->offset, b->size, b->version, b->leases, b->live);
}

static PyObject *block_expired(DramBlock *b, PyObject *now) {
    double t = PyFloat_AsDouble(now), expires = PyFloat_AS_DOUBLE(b->expires);
    if (t == -1.0 && PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(expires != 0.0 && expires <= t);
}

/* The fields that may change after a block is made (offset, leases, version, the flags) take ints and
 * bools only, and none may be deleted: whatever a caller assigns, an entry references nothing that
 * could lead back to it (no cycle the collector would have to find), and nothing whose repr or
 * deallocation runs Python code. Reads go the interpreter's fast way (object members); stores pass here. */
static int block_setattro(PyObject *self, PyObject *name, PyObject *value) {
    if (value == NULL) {
        PyErr_Format(PyExc_AttributeError, "a DramBlock's field %R cannot be deleted", name);
        return -1;
    }
    if (!PyLong_CheckExact(value) && !PyBool_Check(value)) {
        PyErr_Format(PyExc_TypeError, "a DramBlock's field %R takes an int or a bool, not %.100s", name,
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    return PyObject_GenericSetAttr(self, name, value);
}

static PyMethodDef block_methods[] = {
    {"expired", (PyCFunction)block_expired, METH_O, "expired(now) -> bool: it has a TTL, and it ran out by `now`"},
    {NULL, NULL, 0, NULL},
};

/* Object members, as a dataclass's slots are: the interpreter reads and writes them as fast. */
static PyMemberDef block_members[] = {
    {"key", T_OBJECT_EX, offsetof(DramBlock, key), READONLY, NULL},
    {"offset", T_OBJECT_EX, offsetof(DramBlock, offset), 0, NULL},
    {"size", T_OBJECT_EX, offsetof(DramBlock, size), READONLY, NULL},
    {"checksum", T_OBJECT_EX, offsetof(DramBlock, checksum), READONLY, NULL},
    {"expires", T_OBJECT_EX, offsetof(DramBlock, expires), READONLY, NULL},
    {"leases", T_OBJECT_EX, offsetof(DramBlock, leases), 0, NULL},
    {"pinned", T_OBJECT_EX, offsetof(DramBlock, pinned), 0, NULL},
    {"live", T_OBJECT_EX, offsetof(DramBlock, live), 0, NULL},
    {"on_ssd", T_OBJECT_EX, offsetof(DramBlock, on_ssd), 0, NULL},
    {"version", T_OBJECT_EX, offsetof(DramBlock, version), 0, NULL},
    {"checked", T_OBJECT_EX, offsetof(DramBlock, checked), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject kv_DramBlockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvpool.core._native.DramBlock",
    .tp_basicsize = sizeof(DramBlock),
    .tp_dealloc = (destructor)block_dealloc,
    .tp_repr = (reprfunc)block_repr,
    .tp_setattro = block_setattro,
    .tp_flags = Py_TPFLAGS_DEFAULT,  /* no Py_TPFLAGS_HAVE_GC: see the top of this file; no subclasses */
    .tp_doc = "A committed block in the DRAM arena: the DRAM tier's index entry, untracked by the cyclic GC.",
    .tp_methods = block_methods,
    .tp_members = block_members,
    .tp_new = block_new,
};

/* block_columns(blocks) -> bytes: the offsets and sizes (int64), checksums and versions (uint64) of a
 * sequence of DramBlocks, column after column, little-endian: what a LEASE reply carries of its hits,
 * in one pass instead of a Python call per block and column. TypeError for an item of another type. */
PyObject *kv_block_columns(PyObject *self, PyObject *blocks) {
    PyObject *seq = PySequence_Fast(blocks, "block_columns wants a sequence of DramBlocks");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 32 * n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    char *col = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (Py_TYPE(item) != &kv_DramBlockType) {
            PyErr_Format(PyExc_TypeError, "block_columns wants DramBlocks, not %.100s", Py_TYPE(item)->tp_name);
            goto fail;
        }
        DramBlock *b = (DramBlock *)item;
        int64_t offset = PyLong_AsLongLong(b->offset), size = PyLong_AsLongLong(b->size);
        uint64_t checksum = PyLong_AsUnsignedLongLong(b->checksum), version = PyLong_AsUnsignedLongLong(b->version);
        if (PyErr_Occurred())
            goto fail;
        memcpy(col + 8 * i, &offset, 8); /* (little-endian hosts only: see the top) */
        memcpy(col + 8 * (n + i), &size, 8);
        memcpy(col + 8 * (2 * n + i), &checksum, 8);
        memcpy(col + 8 * (3 * n + i), &version, 8);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}

/* Adds the type to `module`; -1 with an exception set on failure. */
int kv_add_dram_block(PyObject *module) {
    if (PyType_Ready(&kv_DramBlockType) < 0)
        return -1;
    Py_INCREF(&kv_DramBlockType);
    if (PyModule_AddObject(module, "DramBlock", (PyObject *)&kv_DramBlockType) < 0) {
        Py_DECREF(&kv_DramBlockType);
        return -1;
    }
    return 0;
}
