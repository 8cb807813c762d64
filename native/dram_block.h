/* The DRAM tier's index entry (dram_block.c), for the index's bulk operations (dram_index.c). */
#ifndef KV_DRAM_BLOCK_H
#define KV_DRAM_BLOCK_H
#include <Python.h>

typedef struct {
    PyObject_HEAD
    PyObject *key;       /* bytes, exactly */
    PyObject *offset;    /* ints, exactly (as made; what is set later is the caller's: typed int) */
    PyObject *size;
    PyObject *checksum;
    PyObject *expires;   /* a float, exactly */
    PyObject *leases;
    PyObject *pinned;    /* bools */
    PyObject *live;
    PyObject *on_ssd;
    PyObject *version;
    PyObject *checked;
} DramBlock;

extern PyTypeObject kv_DramBlockType;

#define DramBlock_CheckExact(o) (Py_TYPE(o) == &kv_DramBlockType)
#endif
