/* The Python entries' argument reading for the plain-loop and CPU-specific kernels (expert_rows.c,
 * rope.c, rmsnorm.c, expert_amx.c, expert_fp32.c, prompt_amx.c): METH_FASTCALL, pointers and sizes
 * passed as ints; the CPU-specific kernels' `ready()`. Include after Python.h. Header-only. */
#ifndef MOECC_PY_ARGS_H
#define MOECC_PY_ARGS_H

/* v[i] = args[i] as an integer for the n == want arguments, skipping those whose bit is set in
 * `skip` (the caller reads them: floats); 0, or -1 with a Python error set (a wrong count names
 * `name`). */
static int int_args(PyObject *const *args, Py_ssize_t n, Py_ssize_t want, const char *name, unsigned skip,
                    long long *v) {
    if (n != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (skip >> i & 1u) continue;
        v[i] = PyLong_AsLongLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* A CPU-specific kernel's `ready()` entry (the AMX kernels, expert_fp32.c) and its method-table
 * line: READY_FN() (1: this build and CPU run the kernel) as a Python int. */
#define PY_READY(READY_FN)                                                                      \
    static PyObject *py_ready(PyObject *self, PyObject *const *args, Py_ssize_t n) {            \
        (void)self, (void)args;                                                                 \
        if (n != 0) return PyErr_Format(PyExc_TypeError, "ready takes no arguments");           \
        return PyLong_FromLong(READY_FN());                                                     \
    }
#define PY_READY_METHOD \
    {"ready", (PyCFunction)(void (*)(void))py_ready, METH_FASTCALL, "ready() -> 1 when this build and CPU run it"}

#endif
