/* The recorder's per-op helpers in C, as a Python extension module (native/__init__.py builds it where Python's
 * headers are installed; where they are not, the recorder does the same in Python, with the same results):
 *
 * - measure, dense_numel: the statistics kernel (stats.c) without ctypes. On a step of tiny tensors (a selective
 *   scan in a Python loop: ~6,700 ops of 4 x 16 x 4 floats) the kernel's arithmetic is ~0.1 us a tensor, and the
 *   ctypes call around it ~1.3 us (eight arguments converted, a ctypes array of three doubles read back), plus the
 *   Python that turned the three sums into the statistics. Here one call takes the tensor's address, dtype code,
 *   element count and (a view that is not one dense range) its shape and strides, and returns the values
 *   `stats._finish` would list, bit for bit. Both compile the same stats.c.
 * - untrack_tree: an op record, handed to the writer, taken off the cyclic garbage collector's lists (see there). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "stats.c"

/* Read a tuple of at most MAXDIM ints (torch.Size or a stride tuple) into out; its length, or -1 (an error set). */
static Py_ssize_t read_ints(PyObject *seq, int64_t *out) {
    Py_ssize_t k, n;
    if (!PyTuple_Check(seq)) {
        PyErr_SetString(PyExc_TypeError, "shape and strides must be tuples");
        return -1;
    }
    n = PyTuple_GET_SIZE(seq);
    if (n > MAXDIM) {
        PyErr_SetString(PyExc_ValueError, "too many dimensions");
        return -1;
    }
    for (k = 0; k < n; k++) {
        long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, k));
        if (v == -1 && PyErr_Occurred())
            return -1;
        out[k] = (int64_t)v;
    }
    return n;
}

/* measure(address, code, n, shape, strides) -> (n, mean, absmax, l2, var, 0, 0), or 1 where a sum or the maximum is
 * not finite (the caller's numpy path measures), or None where the kernel cannot read it. shape and strides None:
 * one dense range of n values at address. The values are stats._finish(n, sum, sum of squares, absmax): the same
 * operations in the same order (built with -ffp-contract=off), so the same bits. A tuple, not _finish's list: packed
 * alike, and the collector stops tracking a tuple of numbers, where a list stays tracked as long as the recorder
 * keeps it (its cache of statistics by storage version: long enough to reach the oldest generation, whose growth
 * brings on full collections of the job's whole heap). */
static PyObject *measure(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t shape[MAXDIM], strides[MAXDIM];
    double out[3], mean, var;
    long long address, n;
    int code, rc, ndim = 0;
    PyObject *values;
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "measure() takes 5 arguments");
        return NULL;
    }
    address = PyLong_AsLongLong(args[0]);
    code = (int)PyLong_AsLong(args[1]);
    n = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (args[3] != Py_None) {
        Py_ssize_t nd = read_ints(args[3], shape);
        if (nd < 0 || read_ints(args[4], strides) != nd)
            return PyErr_Occurred() ? NULL : (PyErr_SetString(PyExc_ValueError, "shape and strides differ"), NULL);
        ndim = (int)nd;
    }
    if (n == 0)
        return Py_BuildValue("(i,d,d,d,d,i,i)", 0, 0.0, 0.0, 0.0, 0.0, 0, 0);
    rc = replaydiff_stats((const void *)(intptr_t)address, code, (int64_t)n, ndim, ndim ? shape : NULL,
                          ndim ? strides : NULL, 1 << 16, out);
    if (rc == 1)
        return PyLong_FromLong(1);
    if (rc != 0)
        Py_RETURN_NONE;
    mean = out[0] / (double)n;
    var = out[1] / (double)n - mean * mean;
    if (0.0 > var) /* Python's max(var, 0.0): var unless 0.0 is greater */
        var = 0.0;
    values = PyTuple_New(7);
    if (values == NULL)
        return NULL;
    PyTuple_SET_ITEM(values, 0, PyLong_FromLongLong(n));
    PyTuple_SET_ITEM(values, 1, PyFloat_FromDouble(mean));
    PyTuple_SET_ITEM(values, 2, PyFloat_FromDouble(out[2]));
    PyTuple_SET_ITEM(values, 3, PyFloat_FromDouble(sqrt(out[1])));
    PyTuple_SET_ITEM(values, 4, PyFloat_FromDouble(var));
    PyTuple_SET_ITEM(values, 5, PyLong_FromLong(0));
    PyTuple_SET_ITEM(values, 6, PyLong_FromLong(0));
    for (int k = 0; k < 7; k++)
        if (PyTuple_GET_ITEM(values, k) == NULL) {
            Py_DECREF(values);
            return NULL;
        }
    return values;
}

/* dense_numel(shape, strides) -> the number of values n where the view covers exactly n consecutive elements from
 * its offset in some order (stats.dense), else -1 - n. stats.dense_numel in C: the same rule, one call. */
static PyObject *dense_numel(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t shape[MAXDIM], strides[MAXDIM], order[MAXDIM], expected = 1, n = 1;
    Py_ssize_t nd, i, j;
    int dense = 1;
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "dense_numel() takes 2 arguments");
        return NULL;
    }
    nd = read_ints(args[0], shape);
    if (nd < 0)
        return NULL;
    if (read_ints(args[1], strides) != nd)
        return PyErr_Occurred() ? NULL : (PyErr_SetString(PyExc_ValueError, "shape and strides differ"), NULL);
    for (i = 0; i < nd; i++)
        n *= shape[i];
    /* row-major first (most tensors), as stats.dense */
    for (i = nd - 1; i >= 0; i--) {
        if (shape[i] != 1) {
            if (shape[i] == 0 || strides[i] != expected)
                break;
            expected *= shape[i];
        }
    }
    if (i >= 0) { /* sorted by (stride, size), as Python's sorted(zip(stride, shape)) */
        for (i = 0; i < nd; i++)
            order[i] = i;
        for (i = 1; i < nd; i++) { /* insertion sort: stable, and a handful of dimensions */
            int64_t k = order[i];
            for (j = i - 1; j >= 0 && (strides[order[j]] > strides[k] ||
                                       (strides[order[j]] == strides[k] && shape[order[j]] > shape[k])); j--)
                order[j + 1] = order[j];
            order[j + 1] = k;
        }
        expected = 1;
        for (i = 0; i < nd; i++) {
            int64_t k = order[i];
            if (shape[k] == 1)
                continue;
            if (strides[k] != expected) {
                dense = 0;
                break;
            }
            expected *= shape[k];
        }
    }
    return PyLong_FromLongLong(dense ? n : -1 - n);
}

/* Untrack obj and what it holds where that is safe; returns whether obj stays tracked. Only exact dicts, lists and
 * tuples are untracked, and only when everything they hold is untracked or never tracked (numbers, strings, None):
 * CPython's rule for tuples (its collector untracks such tuples as it meets them), applied to dicts and lists too, and
 * looser than CPython's, which keeps a container holding any list or dict tracked. That is sound for op records
 * alone, for the reason untrack_tree gives: an untracked list is never tracked again when something is put into it,
 * so a cycle made later through one would never be collected. Anything else stays tracked, and so do the containers
 * above it: an object
 * of another type, a tree deeper than 32, and whatever is met once *budget containers have been walked (a record
 * has a few dozen; the budget keeps a shape the recorder never builds from costing more). */
static int untrack(PyObject *obj, int depth, Py_ssize_t *budget) {
    Py_ssize_t i, n;
    int held = 0;
    if (!PyObject_IS_GC(obj) || !PyObject_GC_IsTracked(obj))
        return 0;
    if (depth > 32 || --*budget < 0)
        return 1;
    if (PyTuple_CheckExact(obj)) {
        n = PyTuple_GET_SIZE(obj);
        for (i = 0; i < n; i++)
            held |= untrack(PyTuple_GET_ITEM(obj, i), depth + 1, budget);
    } else if (PyList_CheckExact(obj)) {
        n = PyList_GET_SIZE(obj);
        for (i = 0; i < n; i++)
            held |= untrack(PyList_GET_ITEM(obj, i), depth + 1, budget);
    } else if (PyDict_CheckExact(obj)) {
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(obj, &pos, &key, &value))
            held |= untrack(key, depth + 1, budget) | untrack(value, depth + 1, budget);
    } else {
        return 1;
    }
    if (!held)
        PyObject_GC_UnTrack(obj);
    return held;
}

/* untrack_tree(record) -> None: the op record's dicts, lists and tuples off the collector's lists (see untrack).
 *
 * Why: a record lives until the writer thread has packed its chunk, long enough for the collector to move it to its
 * oldest generation, and the collector runs a full collection of the whole process (~0.2-0.5 s where torch and a
 * model are loaded) each time that generation has grown by a quarter. Recording the selective scan's step (~6,700
 * ops, ~10 containers a record) brought one on every 3-5 steps, and its young collections walked the waiting
 * records again and again. An op record is plain data the recorder built, fresh for each op: numbers, strings, and
 * containers of them (no argument of the job's is kept in one: encode_value copies lists, and names what it cannot
 * copy); no cycle can run through it, and reference counting frees it once written. What the recorder adds to it
 * later is plain data too (statistics filled into a ref or a cell, a data file's number), and the writer packs every
 * record with msgpack, which takes nothing else. Up to Python 3.13 a dict also takes itself back onto the
 * collector's lists when a container is put into it; from 3.14 CPython neither untracks dicts nor tracks them again,
 * which the reason above does not need. */
static PyObject *untrack_tree(PyObject *self, PyObject *arg) {
    Py_ssize_t budget = 100000;
    (void)self;
    untrack(arg, 0, &budget);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"untrack_tree", untrack_tree, METH_O, "An op record off the cyclic collector's lists (see hotpath.c)."},
    {"measure", (PyCFunction)(void (*)(void))measure, METH_FASTCALL, "A tensor's statistics (see hotpath.c)."},
    {"dense_numel", (PyCFunction)(void (*)(void))dense_numel, METH_FASTCALL,
     "n if a view is one dense range of n values, else -1 - n."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_replaydiff_hotpath", NULL, -1, methods};

PyMODINIT_FUNC PyInit__replaydiff_hotpath(void) { return PyModule_Create(&module); }
