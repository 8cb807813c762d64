/* The DRAM tier's bulk index work (kvpool.core.tiers.dram_tier), each in one pass in C: a same-node put's
 * commit, the worker's hottest path, was a dozen passes of Python over the batch (blocks made, looked up,
 * versions compared, replaced ones unlinked from three tables, new ones entered in three), ~1.7 us a block.
 *
 * new_blocks(keys, offsets, sizes, checksums, versions, checked) -> list[DramBlock]
 *     a block per key (no TTL, no lease, unpinned, live; version 0 where versions is None), as
 *     dram_tier.new_blocks makes them: keys exact bytes, the numbers ints (TypeError otherwise)
 * index_many(blocks, by_slab, order, new, phase, slab_size) -> (stored, free, unlinked, timed) | None
 *     DramTier.insert_many's index work for `new` (DramBlocks of distinct, unpinned keys): a block as old
 *     as or older than the one its key holds is not entered (stored[i] False, its slot in `free`); a newer
 *     one replaces it: the old block leaves `blocks`, its slab's table in `by_slab` and `order` and is no
 *     longer live, its slot in `free` (after the stale blocks') if it has no lease, else it is in
 *     `unlinked` (freed at its last release). Entered blocks go into `blocks`, `by_slab`
 *     ((offset - phase) // slab_size) and the back of `order` (a dict: key -> None). `timed`: the change in the count of indexed blocks with a TTL.
 *     The caller frees `free` and counts the slots no longer reserved. None, having changed nothing,
 *     where a block (new or indexed) is not this module's DramBlock as made (exact ints; an offset a long
 *     long holds): the caller takes its Python path.
 * Both hold the GIL throughout (they only touch Python objects). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "dram_block.h"

/* Each of the sequence's items as an int (a new reference); NULL with an exception set. */
static PyObject *item_int(PyObject *seq, Py_ssize_t i) {
    return PyNumber_Index(PySequence_Fast_GET_ITEM(seq, i));
}

PyObject *kv_new_blocks(PyObject *self, PyObject *args) {
    PyObject *args_seq[5], *seq[5] = {NULL, NULL, NULL, NULL, NULL}, *out = NULL, *zero = NULL, *no_ttl = NULL;
    int checked;
    if (!PyArg_ParseTuple(args, "OOOOOp:new_blocks", &args_seq[0], &args_seq[1], &args_seq[2], &args_seq[3],
                          &args_seq[4], &checked))
        return NULL;
    int columns = args_seq[4] == Py_None ? 4 : 5;
    for (int c = 0; c < columns; c++)  /* (copies: an int's __index__ could change a list as it is read) */
        if (!(seq[c] = PySequence_Tuple(args_seq[c])))
            goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq[0]);
    for (int c = 1; c < columns; c++)
        if (PySequence_Fast_GET_SIZE(seq[c]) != n) {
            PyErr_SetString(PyExc_ValueError, "new_blocks: columns of different lengths");
            goto done;
        }
    if (!(zero = PyLong_FromLong(0)) || !(no_ttl = PyFloat_FromDouble(0.0)) || !(out = PyList_New(n)))
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq[0], i);
        if (!PyBytes_CheckExact(key)) {  /* a subclass could carry attributes, and with them a cycle */
            PyErr_Format(PyExc_TypeError, "DramBlock key must be bytes, not %.100s", Py_TYPE(key)->tp_name);
            goto fail;
        }
        DramBlock *b = (DramBlock *)kv_DramBlockType.tp_alloc(&kv_DramBlockType, 0);
        if (b == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, (PyObject *)b);  /* (its fields NULL until set: dealloc takes that) */
        b->key = Py_NewRef(key);
        if (!(b->offset = item_int(seq[1], i)) || !(b->size = item_int(seq[2], i))
            || !(b->checksum = item_int(seq[3], i))
            || !(b->version = columns == 5 ? item_int(seq[4], i) : Py_NewRef(zero)))
            goto fail;
        b->expires = Py_NewRef(no_ttl);
        b->leases = Py_NewRef(zero);
        b->pinned = Py_NewRef(Py_False);
        b->live = Py_NewRef(Py_True);
        b->on_ssd = Py_NewRef(Py_False);
        b->checked = Py_NewRef(checked ? Py_True : Py_False);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    for (int c = 0; c < 5; c++)
        Py_XDECREF(seq[c]);
    Py_XDECREF(zero);
    Py_XDECREF(no_ttl);
    return out;
}

/* Python's (offset - phase) // slab_size of an int offset, as an int; NULL with an exception set. */
static PyObject *slab_of(PyObject *offset, long long phase, long long slab_size) {
    long long off = PyLong_AsLongLong(offset);
    if (off == -1 && PyErr_Occurred())
        return NULL;
    long long a = off - phase, q = a / slab_size;
    if (a % slab_size != 0 && ((a < 0) != (slab_size < 0)))
        q--;  /* floor, as Python divides */
    return PyLong_FromLongLong(q);
}

/* by_slab[slab][b.offset] = b (the slab's table made if it has none). */
static int place(PyObject *by_slab, DramBlock *b, long long phase, long long slab_size) {
    PyObject *slab = slab_of(b->offset, phase, slab_size);
    if (slab == NULL)
        return -1;
    int rc = -1;
    PyObject *placed = PyDict_GetItemWithError(by_slab, slab);  /* borrowed */
    if (placed != NULL) {
        rc = PyDict_SetItem(placed, b->offset, (PyObject *)b);
    } else if (!PyErr_Occurred() && (placed = PyDict_New()) != NULL) {
        rc = PyDict_SetItem(placed, b->offset, (PyObject *)b) < 0 ? -1 : PyDict_SetItem(by_slab, slab, placed);
        Py_DECREF(placed);
    }
    Py_DECREF(slab);
    return rc;
}

/* del by_slab[slab][b.offset], and the slab's table with its last block (KeyError if not placed). */
static int unplace(PyObject *by_slab, DramBlock *b, long long phase, long long slab_size) {
    PyObject *slab = slab_of(b->offset, phase, slab_size);
    if (slab == NULL)
        return -1;
    int rc = -1;
    PyObject *placed = PyDict_GetItemWithError(by_slab, slab);  /* borrowed */
    if (placed == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, slab);
    } else if (PyDict_DelItem(placed, b->offset) == 0) {
        rc = PyDict_GET_SIZE(placed) == 0 ? PyDict_DelItem(by_slab, slab) : 0;
    }
    Py_DECREF(slab);
    return rc;
}

/* order.pop(key, None) */
static int discard(PyObject *order, PyObject *key) {
    if (PyDict_DelItem(order, key) == 0)
        return 0;
    if (!PyErr_ExceptionMatches(PyExc_KeyError))
        return -1;
    PyErr_Clear();
    return 0;
}

/* Whether a block's fields are those a DramBlock is made with (exact ints; its offset such that
 * offset - phase is a long long): then nothing the index work reads of it runs Python code. A field
 * stored through its member descriptor (DramBlock.version.__set__) bypasses block_setattro's check. */
static int plain(DramBlock *b, long long phase, int old) {
    if (!PyLong_CheckExact(b->offset) || !PyLong_CheckExact(b->version) || (old && !PyLong_CheckExact(b->leases)))
        return 0;
    int overflow = 0;
    long long off = PyLong_AsLongLongAndOverflow(b->offset, &overflow), diff;
    return !overflow && !__builtin_sub_overflow(off, phase, &diff);
}

/* The old block `o` leaves the index for `b` (of its key): out of its slab's table and `order`, no
 * longer live, its slot to free or itself to unlink; `timed` counts a TTL gone. */
static int replace(DramBlock *o, PyObject *by_slab, PyObject *order, long long phase, long long slab_size,
                   PyObject *freed, PyObject *unlinked, long *timed) {
    if (discard(order, o->key) < 0 || unplace(by_slab, o, phase, slab_size) < 0)
        return -1;
    Py_SETREF(o->live, Py_NewRef(Py_False));
    if (PyFloat_AS_DOUBLE(o->expires) != 0.0)
        (*timed)--;
    int leased = PyObject_IsTrue(o->leases);
    if (leased < 0)
        return -1;
    return PyList_Append(leased ? unlinked : freed, leased ? (PyObject *)o : o->offset);
}

PyObject *kv_index_many(PyObject *self, PyObject *args) {
    PyObject *blocks, *by_slab, *order, *new;
    long long phase, slab_size;
    if (!PyArg_ParseTuple(args, "O!O!O!O!LL:index_many", &PyDict_Type, &blocks, &PyDict_Type, &by_slab,
                          &PyDict_Type, &order, &PyList_Type, &new, &phase, &slab_size))
        return NULL;
    if (slab_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "index_many: slab_size must be positive");
        return NULL;
    }
    PyObject *result = NULL, *stored = NULL, *free = NULL, *freed = NULL, *unlinked = NULL;
    if ((new = PyList_AsTuple(new)) == NULL)  /* (a copy: the caller's list is the caller's) */
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(new);
    long timed = 0;
    PyObject **old = PyMem_Calloc(n ? n : 1, sizeof(PyObject *));  /* strong: the index lets go of them */
    char *enter = PyMem_Malloc(n ? n : 1);
    if (old == NULL || enter == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* First every decision, changing nothing: a block of another type, or not plain, leaves all to the
     * caller. No Python code runs from here on (exact bytes keys and ints: their hashes and compares). */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(new, i);
        if (!DramBlock_CheckExact(item) || !plain((DramBlock *)item, phase, 0))
            goto other;
        DramBlock *b = (DramBlock *)item;
        PyObject *o = PyDict_GetItemWithError(blocks, b->key);  /* borrowed */
        enter[i] = 1;
        if (o == NULL) {
            if (PyErr_Occurred())
                goto done;
            continue;
        }
        if (!DramBlock_CheckExact(o) || !plain((DramBlock *)o, phase, 1))
            goto other;
        old[i] = Py_NewRef(o);
        int older = PyObject_RichCompareBool(b->version, ((DramBlock *)o)->version, Py_LE);
        if (older < 0)
            goto done;
        enter[i] = !older;
    }
    if (!(stored = PyList_New(n)) || !(free = PyList_New(0)) || !(freed = PyList_New(0))
        || !(unlinked = PyList_New(0)))
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        DramBlock *b = (DramBlock *)PyTuple_GET_ITEM(new, i);
        PyList_SET_ITEM(stored, i, Py_NewRef(enter[i] ? Py_True : Py_False));
        if (!enter[i]) {
            if (PyList_Append(free, b->offset) < 0)
                goto done;
            continue;
        }
        if (old[i] != NULL
            && replace((DramBlock *)old[i], by_slab, order, phase, slab_size, freed, unlinked, &timed) < 0)
            goto done;
        if (PyDict_SetItem(blocks, b->key, (PyObject *)b) < 0 || place(by_slab, b, phase, slab_size) < 0
            || PyDict_SetItem(order, b->key, Py_None) < 0)
            goto done;
        if (PyFloat_AS_DOUBLE(b->expires) != 0.0)
            timed++;
    }
    /* the stale blocks' slots, then the replaced ones', as the Python passes free them (the same free
     * lists: the next allocations hand out the same slots) */
    if (PyList_SetSlice(free, PyList_GET_SIZE(free), PyList_GET_SIZE(free), freed) < 0)
        goto done;
    result = Py_BuildValue("(OOOl)", stored, free, unlinked, timed);
    goto done;
other:
    result = Py_NewRef(Py_None);
done:
    if (old != NULL)
        for (Py_ssize_t i = 0; i < n; i++)
            Py_XDECREF(old[i]);
    PyMem_Free(old);
    PyMem_Free(enter);
    Py_XDECREF(stored);
    Py_XDECREF(free);
    Py_XDECREF(freed);
    Py_XDECREF(unlinked);
    Py_DECREF(new);
    return result;
}
