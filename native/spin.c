/* spin_readable(fd, spin_us) -> bool: whether a socket has something to read within `spin_us`
 * microseconds, asked without going to sleep (kvpool.core.reply_spin).
 *
 * A receive that sleeps is woken by the sender's kernel: on a VM, an interrupt to an idle virtual CPU,
 * after which the sleeper runs tens of microseconds after the send (the send itself takes a few). A
 * client whose worker is about to answer asks the socket instead (a peeking, non-blocking
 * receive), with the CPU's pause instruction between asks (it hands the core's resources to a sibling
 * hardware thread), and the GIL let go. True also when the peer closed the socket or it failed: the
 * caller's own receive then says so. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <sys/socket.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KV_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define KV_RELAX() __asm__ __volatile__("yield")
#else
#define KV_RELAX() ((void)0)
#endif

#define KV_RELAX_EVERY 32 /* pauses between two asks: ~1 µs, so a socket is asked about a million times a second at most */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

PyObject *kv_spin_readable(PyObject *self, PyObject *args) {
    int fd;
    double spin_us;
    if (!PyArg_ParseTuple(args, "id:spin_readable", &fd, &spin_us))
        return NULL;
    if (fd < 0 || !(spin_us >= 0 && spin_us <= 1e6)) {
        /* (PyErr_Format has no %g: the spin is printed by Python) */
        PyObject *spin = PyFloat_FromDouble(spin_us);
        if (spin != NULL) {
            PyErr_Format(PyExc_ValueError, "spin_readable wants a descriptor >= 0 and 0 to 1e6 microseconds "
                         "(got %d, %R)", fd, spin);
            Py_DECREF(spin);
        }
        return NULL;
    }
    int ready = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t until = now_ns() + (int64_t)(spin_us * 1000.0);
    for (;;) {
        char c;
        ssize_t k = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        if (k >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
            ready = 1; /* bytes, the peer's close, or a failure the caller's receive reports */
            break;
        }
        if (now_ns() >= until)
            break;
        for (int i = 0; i < KV_RELAX_EVERY; i++)
            KV_RELAX();
    }
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ready);
}
