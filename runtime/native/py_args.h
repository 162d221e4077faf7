/* The Python entries' argument reading for the plain-loop kernels (expert_rows.c, rope.c,
 * rmsnorm.c): METH_FASTCALL, pointers and sizes passed as ints. Include after Python.h.
 * Header-only. */
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

#endif
