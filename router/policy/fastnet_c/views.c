/* ClusterTracker.view's snapshots, built from the trackers in C (router/policy/tracking.py is the reference).
 *
 * bind_view(snapshot_cls, tracker_cls, sources) gives the table: for every field of the snapshot class, in order,
 * (field, kind, tracker attribute) with kind "copy" (the attribute's value), "since" (max(0, now - attribute),
 * inf while it is None) or "match" (the call's prefix match, no attribute). Both classes are read and written by
 * slot offset; a tracker of another class (a subclass with properties) is read with getattr.
 */
#include "fastnet.h"
#include <structmember.h>
#include <math.h>
#include <string.h>

enum { SRC_COPY, SRC_SINCE, SRC_MATCH, N_SRC };
static const char *SRC_NAMES[N_SRC] = {"copy", "since", "match"};

static struct {
    Py_ssize_t n;               /* snapshot fields */
    PyTypeObject *snapshot, *tracker;
    PyObject **field, **attr;   /* per field: its name, the tracker attribute it comes from (NULL: the match) */
    int *kind;
    Py_ssize_t *snap_off, *tracker_off;
} view;

Py_ssize_t plain_slot(PyObject *cls, PyObject *name)
{
    PyObject *d = PyObject_GetAttr(cls, name);
    if (!d) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -2;
        PyErr_Clear();
        return -1;
    }
    Py_ssize_t off = -1;
    if (Py_IS_TYPE(d, &PyMemberDescr_Type) && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX)
        off = ((PyMemberDescrObject *)d)->d_member->offset;
    Py_DECREF(d);
    return off;
}

static void free_names(PyObject **names, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; names && i < n; i++)
        Py_XDECREF(names[i]);
    PyMem_Free(names);
}

/* bind_view(snapshot_cls, tracker_cls, sources) -> None when bound, else "Class.attribute" naming the first field
 * that is not a plain slot (the binding then stays as it was) */
PyObject *py_bind_view(PyObject *self, PyObject *args)
{
    PyObject *snap_cls, *tracker_cls, *sources;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyType_Type, &snap_cls, &PyType_Type, &tracker_cls, &PyTuple_Type, &sources))
        return NULL;
    const Py_ssize_t n = PyTuple_GET_SIZE(sources);
    PyObject **field = PyMem_Calloc(n ? n : 1, sizeof(PyObject *)), **attr = PyMem_Calloc(n ? n : 1, sizeof(PyObject *));
    int *kind = PyMem_Calloc(n ? n : 1, sizeof(int));
    Py_ssize_t *snap_off = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t)), *tracker_off = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t));
    PyObject *res = NULL;
    if (!field || !attr || !kind || !snap_off || !tracker_off) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f, *a;
        const char *k;
        PyObject *src = PyTuple_GET_ITEM(sources, i);
        if (!PyTuple_Check(src)) {
            PyErr_SetString(PyExc_TypeError, "bind_view: a source is a tuple (field, kind, attribute)");
            goto fail;
        }
        if (!PyArg_ParseTuple(src, "UsO;bind_view: a source is (field, kind, attribute)", &f, &k, &a))
            goto fail;
        kind[i] = -1;
        for (int s = 0; s < N_SRC; s++)
            if (!strcmp(k, SRC_NAMES[s]))
                kind[i] = s;
        if (kind[i] < 0 || (kind[i] == SRC_MATCH) != (a == Py_None) || (a != Py_None && !PyUnicode_Check(a))) {
            PyErr_Format(PyExc_ValueError, "bind_view: field %R: kind %s with attribute %R", f, k, a);
            goto fail;
        }
        field[i] = Py_NewRef(f);
        PyUnicode_InternInPlace(&field[i]);
        if (a != Py_None) {
            attr[i] = Py_NewRef(a);
            PyUnicode_InternInPlace(&attr[i]);
        }
        PyObject *missing_cls = NULL, *missing = NULL;
        if ((snap_off[i] = plain_slot(snap_cls, field[i])) < 0)
            missing_cls = snap_cls, missing = field[i];
        else if (attr[i] && (tracker_off[i] = plain_slot(tracker_cls, attr[i])) < 0)
            missing_cls = tracker_cls, missing = attr[i];
        if (missing) {
            if (snap_off[i] == -2 || tracker_off[i] == -2)
                goto fail;
            res = PyUnicode_FromFormat("%s.%U", ((PyTypeObject *)missing_cls)->tp_name, missing);
            goto fail;
        }
    }
    free_names(view.field, view.n);
    free_names(view.attr, view.n);
    PyMem_Free(view.kind);
    PyMem_Free(view.snap_off);
    PyMem_Free(view.tracker_off);
    view.n = n, view.field = field, view.attr = attr, view.kind = kind, view.snap_off = snap_off, view.tracker_off = tracker_off;
    Py_XSETREF(view.snapshot, (PyTypeObject *)Py_NewRef(snap_cls));
    Py_XSETREF(view.tracker, (PyTypeObject *)Py_NewRef(tracker_cls));
    Py_RETURN_NONE;
fail:
    free_names(field, n);
    free_names(attr, n);
    PyMem_Free(kind);
    PyMem_Free(snap_off);
    PyMem_Free(tracker_off);
    return res;
}

/* A new reference to the tracker attribute of field i, or NULL with an exception set */
static PyObject *tracker_attr(PyObject *t, Py_ssize_t i)
{
    if (Py_TYPE(t) != view.tracker)
        return PyObject_GetAttr(t, view.attr[i]);
    PyObject *x = *(PyObject **)((char *)t + view.tracker_off[i]);
    if (!x)
        PyErr_SetObject(PyExc_AttributeError, view.attr[i]);
    return Py_XNewRef(x);
}

/* max(0, now - last), inf when never set: the same float Python's expression gives for float times */
static PyObject *since(PyObject *last, double now)
{
    if (last == Py_None)
        return PyFloat_FromDouble(INFINITY);
    const double l = PyFloat_AsDouble(last);
    if (l == -1.0 && PyErr_Occurred())
        return NULL;
    return PyFloat_FromDouble(now > l ? now - l : 0.0);
}

/* snapshots(trackers, now_s, matches) -> tuple: a snapshot per tracker; matches is None (no prefix match anywhere)
 * or a list of ints, one per tracker */
PyObject *py_snapshots(PyObject *self, PyObject *args)
{
    PyObject *trackers, *matches;
    double now;
    if (!PyArg_ParseTuple(args, "O!dO", &PyList_Type, &trackers, &now, &matches))
        return NULL;
    if (!view.snapshot) {
        PyErr_SetString(PyExc_RuntimeError, "snapshots: bind_view() has not bound the view types");
        return NULL;
    }
    const Py_ssize_t n = PyList_GET_SIZE(trackers);
    if (matches != Py_None && (!PyList_Check(matches) || PyList_GET_SIZE(matches) != n)) {
        PyErr_SetString(PyExc_ValueError, "snapshots: matches must be None or a list as long as trackers");
        return NULL;
    }
    PyObject *out = PyTuple_New(n);
    if (!out)
        return NULL;
    PyObject *zero = PyLong_FromLong(0);
    if (!zero)
        goto fail;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *t = PyList_GET_ITEM(trackers, k);
        PyObject *snap = view.snapshot->tp_alloc(view.snapshot, 0);
        if (!snap)
            goto fail;
        PyTuple_SET_ITEM(out, k, snap);
        for (Py_ssize_t i = 0; i < view.n; i++) {
            PyObject *v;
            if (view.kind[i] == SRC_MATCH)
                v = Py_NewRef(matches == Py_None ? zero : PyList_GET_ITEM(matches, k));
            else if (view.kind[i] == SRC_SINCE) {
                PyObject *last = tracker_attr(t, i);
                v = last ? since(last, now) : NULL;
                Py_XDECREF(last);
            } else
                v = tracker_attr(t, i);
            if (!v)
                goto fail;
            *(PyObject **)((char *)snap + view.snap_off[i]) = v;
        }
    }
    Py_DECREF(zero);
    return out;
fail:
    Py_XDECREF(zero);
    Py_DECREF(out);
    return NULL;
}
