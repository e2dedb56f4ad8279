/* router.scale._shared: router/scale/shared.py's host-wide in-flight counters, int64[workers, per_worker, fields] in
 * shared memory, read and written in C (numpy's sum and slice assignment cost tens of microseconds on the cold caches
 * of a live decision). router/scale/shared.py holds the Python reference and uses it where this is not built. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* sum_rows(counters, workers, per_worker, fields, ncols) -> [[sum over workers] per field] per column < ncols */
static PyObject *py_sum_rows(PyObject *self, PyObject *args)
{
    Py_buffer b;
    Py_ssize_t workers, per_worker, fields, ncols;
    if (!PyArg_ParseTuple(args, "y*nnnn", &b, &workers, &per_worker, &fields, &ncols))
        return NULL;
    if (workers < 1 || fields < 1 || ncols < 0 || ncols > per_worker ||
        b.len < (Py_ssize_t)sizeof(int64_t) * workers * per_worker * fields) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "sum_rows: the buffer does not hold int64[workers, per_worker, fields]");
        return NULL;
    }
    const int64_t *c = (const int64_t *)b.buf;
    PyObject *out = PyList_New(ncols);
    for (Py_ssize_t col = 0; out && col < ncols; col++) {
        PyObject *row = PyList_New(fields);
        if (!row) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, col, row);
        for (Py_ssize_t f = 0; f < fields; f++) {
            int64_t sum = 0;
            for (Py_ssize_t w = 0; w < workers; w++)
                sum += c[(w * per_worker + col) * fields + f];
            PyObject *v = PyLong_FromLongLong(sum);
            if (!v) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(row, f, v);
        }
    }
    PyBuffer_Release(&b);
    return out;
}

/* put_row(counters, offset, values): counters[offset : offset + len(values)] = values (int64, one writer per row) */
static PyObject *py_put_row(PyObject *self, PyObject *args)
{
    Py_buffer b;
    Py_ssize_t offset;
    PyObject *values;
    if (!PyArg_ParseTuple(args, "w*nO!", &b, &offset, &PyList_Type, &values))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(values);
    if (offset < 0 || (offset + n) * (Py_ssize_t)sizeof(int64_t) > b.len) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "put_row: the row does not fit in the buffer");
        return NULL;
    }
    int64_t *c = (int64_t *)b.buf + offset;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PyList_GET_ITEM(values, i));
        if (v == -1 && PyErr_Occurred()) {
            PyBuffer_Release(&b);
            return NULL;
        }
        c[i] = v;
    }
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"sum_rows", py_sum_rows, METH_VARARGS, "sum_rows(counters, workers, per_worker, fields, ncols): the host-wide sums"},
    {"put_row", py_put_row, METH_VARARGS, "put_row(counters, offset, values): one worker's row"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_shared", "router.scale.shared's counters, in C.", -1, methods};

PyMODINIT_FUNC PyInit__shared(void) { return PyModule_Create(&module); }
