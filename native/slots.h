/* A slot of a mapping, checked: shared by the copies (module.c) and a same-node read's checks
 * (batch_checks.c). */
#ifndef KV_SLOTS_H
#define KV_SLOTS_H
#include <Python.h>
#include <stdint.h>

/* Whether the slot of b bytes at offset a lies within a buffer of len bytes. */
static inline int slot_inside(int64_t a, int64_t b, Py_ssize_t len) {
    return a >= 0 && b >= 0 && a <= len && b <= len - a;
}
#endif
