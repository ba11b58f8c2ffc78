/* The ring's atomic accesses to shared memory: what aiobroadcast/_shm/atomic.py exports; and
 * Held, the blocking roles' lock (aiobroadcast/_owned.py), at the end.
 *
 * Every word of a channel's segment that more than one process reads and writes (head, closed,
 * next_msg, wait_target, the waiting words, the reader records, the slots' seq words) goes
 * through a Words object: an index reads the word with one 8-byte load-acquire, an assignment
 * writes it with one 8-byte store-release. fence() is a full (sequentially consistent) barrier,
 * fence_acquire() and fence_release() the two halves a seqlock needs. docs/design.md, "Memory
 * ordering", says which ordering each step of the protocol needs and where it gets it.
 *
 * What the compiler emits (GCC and Clang, -O2):
 *   x86-64:  load-acquire = mov, store-release = mov, fence = mfence (or lock or),
 *            fence_acquire / fence_release = nothing (compiler barriers only: TSO gives them);
 *   aarch64: load-acquire = ldar, store-release = stlr, fence = dmb ish,
 *            fence_acquire = dmb ishld, fence_release = dmb ish.
 * Each word is 8-byte aligned (checked when a Words is made), so each access is single-copy
 * atomic on both: a reader never sees half of an old value and half of a new one.
 *
 * A Words holds a buffer export of the mapping (the mapping cannot be unmapped under it) until
 * release(); after that every access raises ValueError. All of it runs with the GIL held.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <time.h>
#include "pythread.h"

#if !defined(__GNUC__) && !defined(__clang__)
#error "aiobroadcast's atomics need GCC or Clang (__atomic builtins)"
#endif

typedef struct {
    PyObject_HEAD
    Py_buffer view;      /* the export of the mapping; view.obj == NULL once released */
    uint64_t *base;      /* the first word */
    Py_ssize_t step;     /* words between two items */
    Py_ssize_t count;    /* items */
    int writable;
} WordsObject;

static int
words_ready(WordsObject *self)
{
    if (self->view.obj == NULL) {
        PyErr_SetString(PyExc_ValueError, "operation forbidden on released Words");
        return 0;
    }
    return 1;
}

static uint64_t *
words_at(WordsObject *self, PyObject *key)
{
    Py_ssize_t i;
    if (!words_ready(self)) {
        return NULL;
    }
    i = PyNumber_AsSsize_t(key, PyExc_IndexError);
    if (i == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (i < 0) {
        i += self->count;
    }
    if (i < 0 || i >= self->count) {
        PyErr_SetString(PyExc_IndexError, "Words index out of range");
        return NULL;
    }
    return self->base + i * self->step;
}

static PyObject *
words_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "start", "step", "count", NULL};
    PyObject *obj;
    Py_ssize_t start = 0, step = 1, count = -1, words;
    WordsObject *self;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|nnn:Words", kwlist, &obj, &start, &step, &count)) {
        return NULL;
    }
    self = (WordsObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    if (PyObject_GetBuffer(obj, &self->view, PyBUF_WRITABLE) == 0) {
        self->writable = 1;
    } else {
        PyErr_Clear();
        if (PyObject_GetBuffer(obj, &self->view, PyBUF_SIMPLE) != 0) {
            self->view.obj = NULL;
            Py_DECREF(self);
            return NULL;
        }
    }
    words = self->view.len / 8;
    if (((uintptr_t)self->view.buf & 7) != 0) {
        PyErr_SetString(PyExc_ValueError, "Words: the buffer is not 8-byte aligned");
        goto fail;
    }
    if (step < 1 || start < 0 || start > words) {
        PyErr_SetString(PyExc_ValueError, "Words: start or step out of range");
        goto fail;
    }
    if (count < 0) {
        count = (words - start + step - 1) / step;
    }
    if (count > 0 && start + (count - 1) * step >= words) {
        PyErr_SetString(PyExc_ValueError, "Words: count reaches past the buffer");
        goto fail;
    }
    self->base = (uint64_t *)self->view.buf + start;
    self->step = step;
    self->count = count;
    return (PyObject *)self;
fail:
    PyBuffer_Release(&self->view);
    self->view.obj = NULL;
    Py_DECREF(self);
    return NULL;
}

static void
words_dealloc(WordsObject *self)
{
    if (self->view.obj != NULL) {
        PyBuffer_Release(&self->view);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t
words_length(WordsObject *self)
{
    if (!words_ready(self)) {
        return -1;
    }
    return self->count;
}

/* w[i]: one 8-byte load-acquire. */
static PyObject *
words_subscript(WordsObject *self, PyObject *key)
{
    uint64_t *p = words_at(self, key);
    if (p == NULL) {
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(__atomic_load_n(p, __ATOMIC_ACQUIRE));
}

/* w[i] = v: one 8-byte store-release. */
static int
words_ass_subscript(WordsObject *self, PyObject *key, PyObject *value)
{
    uint64_t *p;
    unsigned long long v;
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "cannot delete a word");
        return -1;
    }
    p = words_at(self, key);
    if (p == NULL) {
        return -1;
    }
    if (!self->writable) {
        PyErr_SetString(PyExc_TypeError, "Words: the mapping is read-only");
        return -1;
    }
    if (PyLong_CheckExact(value)) {
        v = PyLong_AsUnsignedLongLong(value);
    } else {
        PyObject *index = PyNumber_Index(value);
        if (index == NULL) {
            return -1;
        }
        v = PyLong_AsUnsignedLongLong(index);
        Py_DECREF(index);
    }
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    __atomic_store_n(p, (uint64_t)v, __ATOMIC_RELEASE);
    return 0;
}

/* Every item, each with a load-acquire, in order. */
static PyObject *
words_tolist(WordsObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *out, *item;
    Py_ssize_t i;
    if (!words_ready(self)) {
        return NULL;
    }
    out = PyList_New(self->count);
    if (out == NULL) {
        return NULL;
    }
    for (i = 0; i < self->count; i++) {
        item = PyLong_FromUnsignedLongLong(__atomic_load_n(self->base + i * self->step, __ATOMIC_ACQUIRE));
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

/* Whether any item is not zero (load-acquire each until one is). */
static PyObject *
words_any(WordsObject *self, PyObject *Py_UNUSED(ignored))
{
    Py_ssize_t i;
    if (!words_ready(self)) {
        return NULL;
    }
    for (i = 0; i < self->count; i++) {
        if (__atomic_load_n(self->base + i * self->step, __ATOMIC_ACQUIRE) != 0) {
            Py_RETURN_TRUE;
        }
    }
    Py_RETURN_FALSE;
}

static PyObject *
words_release(WordsObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->view.obj != NULL) {
        PyBuffer_Release(&self->view);
        self->view.obj = NULL;
        self->base = NULL;
        self->count = 0;
    }
    Py_RETURN_NONE;
}

static PyObject *
words_get_released(WordsObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->view.obj == NULL);
}

static PyMethodDef words_methods[] = {
    {"tolist", (PyCFunction)words_tolist, METH_NOARGS, "Every item, each read with a load-acquire."},
    {"any", (PyCFunction)words_any, METH_NOARGS, "Whether any item is not zero (load-acquire)."},
    {"release", (PyCFunction)words_release, METH_NOARGS, "Give the buffer back; later accesses raise."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef words_getset[] = {
    {"released", (getter)words_get_released, NULL, "Whether release() was called.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMappingMethods words_as_mapping = {
    (lenfunc)words_length,
    (binaryfunc)words_subscript,
    (objobjargproc)words_ass_subscript,
};

static PyTypeObject WordsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aiobroadcast._shm._atomics.Words",
    .tp_basicsize = sizeof(WordsObject),
    .tp_dealloc = (destructor)words_dealloc,
    .tp_as_mapping = &words_as_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Words(buffer, start=0, step=1, count=-1): 8-byte words of a shared buffer, item i at "
              "word start + i*step. w[i] is a load-acquire, w[i] = v a store-release.",
    .tp_methods = words_methods,
    .tp_getset = words_getset,
    .tp_new = words_new,
};

static PyObject *
atomics_fence(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *
atomics_fence_acquire(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    Py_RETURN_NONE;
}

static PyObject *
atomics_fence_release(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    __atomic_thread_fence(__ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* Held: the blocking roles' lock (aiobroadcast/_owned.py). A lock that knows the thread holding
 * it and how many times that thread took it, with two calls:
 *   take(timeout) -> 1 taken; 0 held by another thread (timeout 0) or the timeout passed; -1
 *       already held by this thread: taken once more (the caller's release gives it back).
 *       timeout < 0 waits for good; a wait is interrupted by signals, whose handlers run here
 *       (an exception from one propagates, the lock not taken), then the wait goes on.
 *   release() -> gives back one level if this thread holds it; nothing otherwise.
 * Every state change is made in C with the GIL held, so no signal handler (a Ctrl-C's
 * KeyboardInterrupt, raised by the eval loop between bytecodes only) runs between a look and
 * the change it decides: a caller's finally may call release() whether or not its take got
 * the lock, and no Ctrl-C can leave it held. The wait itself is CPython's own lock wait
 * (PyThread_acquire_lock_timed with intr_flag, as _thread's locks). */
typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    unsigned long owner; /* the holding thread's ident, 0 when free */
    long level;          /* how many times it took it */
} HeldObject;

static double
monotonic_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static PyObject *
held_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    HeldObject *self;
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "Held() takes no arguments");
        return NULL;
    }
    self = (HeldObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->lock = PyThread_allocate_lock();
    if (self->lock == NULL) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_MemoryError, "cannot allocate a lock");
        return NULL;
    }
    return (PyObject *)self;
}

static void
held_dealloc(HeldObject *self)
{
    if (self->lock != NULL) {
        if (self->owner != 0) {
            PyThread_release_lock(self->lock);
        }
        PyThread_free_lock(self->lock);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
held_take(HeldObject *self, PyObject *arg)
{
    unsigned long me = PyThread_get_thread_ident();
    double timeout = PyFloat_AsDouble(arg);
    double deadline = 0.0;
    PyLockStatus r;
    if (timeout == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    if (self->owner == me) {
        self->level++;
        return PyLong_FromLong(-1);
    }
    r = PyThread_acquire_lock_timed(self->lock, 0, 0);
    if (r != PY_LOCK_ACQUIRED && timeout != 0.0) {
        if (timeout > 0) {
            deadline = monotonic_s() + timeout;
        }
        for (;;) {
            PY_TIMEOUT_T us = -1;
            if (timeout > 0) {
                double left = deadline - monotonic_s();
                if (left <= 0) {
                    break;
                }
                us = left * 1e6 >= (double)PY_TIMEOUT_MAX ? PY_TIMEOUT_MAX : (PY_TIMEOUT_T)(left * 1e6);
            }
            Py_BEGIN_ALLOW_THREADS
            r = PyThread_acquire_lock_timed(self->lock, us, 1);
            Py_END_ALLOW_THREADS
            if (r != PY_LOCK_INTR) {
                break;
            }
            if (Py_MakePendingCalls() < 0) { /* a signal handler raised: not taken */
                return NULL;
            }
        }
    }
    if (r != PY_LOCK_ACQUIRED) {
        return PyLong_FromLong(0);
    }
    self->owner = me;
    self->level = 1;
    return PyLong_FromLong(1);
}

static PyObject *
held_release(HeldObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->owner == PyThread_get_thread_ident()) {
        if (--self->level == 0) {
            self->owner = 0;
            PyThread_release_lock(self->lock);
        }
    }
    Py_RETURN_NONE;
}

static PyObject *
held_mine(HeldObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(self->owner == PyThread_get_thread_ident());
}

static PyObject *
held_get_owner(HeldObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLong(self->owner);
}

/* Held's tables, laid out as Words' above: the shape CPython's type API asks of every type. */
static PyMethodDef held_methods[] = {
    {"take", (PyCFunction)held_take, METH_O,
     "take(timeout): 1 taken, 0 not (held elsewhere, or the timeout passed), -1 taken again by its holder."},
    {"release", (PyCFunction)held_release, METH_NOARGS, "Give back one level if this thread holds it."},
    {"mine", (PyCFunction)held_mine, METH_NOARGS, "Whether this thread holds it."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef held_getset[] = {
    {"owner", (getter)held_get_owner, NULL, "The holding thread's ident, 0 when free.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject HeldType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aiobroadcast._shm._atomics.Held",
    .tp_basicsize = sizeof(HeldObject),
    .tp_dealloc = (destructor)held_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Held(): a lock that knows its holder; take(timeout) and release() (see _atomics.c).",
    .tp_methods = held_methods,
    .tp_getset = held_getset,
    .tp_new = held_new,
};

static PyMethodDef atomics_methods[] = {
    {"fence", atomics_fence, METH_NOARGS, "A full memory barrier: earlier stores before later loads."},
    {"fence_acquire", atomics_fence_acquire, METH_NOARGS, "Earlier loads before later loads and stores."},
    {"fence_release", atomics_fence_release, METH_NOARGS, "Earlier loads and stores before later stores."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef atomics_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "aiobroadcast._shm._atomics",
    .m_doc = "Atomic loads, stores and fences on shared memory (see aiobroadcast/_shm/atomic.py).",
    .m_size = -1,
    .m_methods = atomics_methods,
};

PyMODINIT_FUNC
PyInit__atomics(void)
{
    PyObject *m;
    if (PyType_Ready(&WordsType) < 0 || PyType_Ready(&HeldType) < 0) {
        return NULL;
    }
    m = PyModule_Create(&atomics_module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&WordsType);
    if (PyModule_AddObject(m, "Words", (PyObject *)&WordsType) < 0) {
        Py_DECREF(&WordsType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&HeldType);
    if (PyModule_AddObject(m, "Held", (PyObject *)&HeldType) < 0) {
        Py_DECREF(&HeldType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
