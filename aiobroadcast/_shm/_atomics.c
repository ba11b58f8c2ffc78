/* The ring's atomic accesses to shared memory: what aiobroadcast/_shm/atomic.py exports; and
 * release_held, the blocking roles' lock release (aiobroadcast/_owned.py), at the end.
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

/* release_held(owned): give back owned._lock (a threading.RLock) if this thread holds it, with
 * owned.owner set to 0 first; nothing otherwise. aiobroadcast/_owned.py's release. In C so that
 * no signal handler (a Ctrl-C's KeyboardInterrupt) can run between the look and the release:
 * the eval loop runs handlers only between bytecodes, and none runs here (RLock's methods and
 * an instance attribute's store are C). A caller's ``finally`` may call it whether or not its
 * acquire got the lock. */
static PyObject *str_lock, *str_owner, *str_is_owned, *str_release, *zero;

static PyObject *
atomics_release_held(PyObject *Py_UNUSED(module), PyObject *owned)
{
    PyObject *lock, *r;
    int held;
    lock = PyObject_GetAttr(owned, str_lock);
    if (lock == NULL) {
        return NULL;
    }
    r = PyObject_CallMethodNoArgs(lock, str_is_owned);
    if (r == NULL) {
        Py_DECREF(lock);
        return NULL;
    }
    held = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (held > 0) {
        if (PyObject_SetAttr(owned, str_owner, zero) < 0) {
            Py_DECREF(lock);
            return NULL;
        }
        r = PyObject_CallMethodNoArgs(lock, str_release);
        if (r == NULL) {
            Py_DECREF(lock);
            return NULL;
        }
        Py_DECREF(r);
    }
    Py_DECREF(lock);
    if (held < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef atomics_methods[] = {
    {"release_held", atomics_release_held, METH_O,
     "Release owned._lock (an RLock) if this thread holds it, setting owned.owner to 0 first."},
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
    if (PyType_Ready(&WordsType) < 0) {
        return NULL;
    }
    str_lock = PyUnicode_InternFromString("_lock");
    str_owner = PyUnicode_InternFromString("owner");
    str_is_owned = PyUnicode_InternFromString("_is_owned");
    str_release = PyUnicode_InternFromString("release");
    zero = PyLong_FromLong(0);
    if (str_lock == NULL || str_owner == NULL || str_is_owned == NULL || str_release == NULL || zero == NULL) {
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
    return m;
}
