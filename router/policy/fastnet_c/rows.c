/* build_features rows from the snapshots, by the column table router/policy/feature_binding.py binds (from
 * router/policy/feature_table.py; router/policy/feature_rows.py is the reference, and tests/policy/test_features_fast.py
 * holds the two to the same bytes).
 *
 * bind_rows(snapshot_cls, columns): one (op, names, refs, x, log, scale) per column, in order. A column's raw value
 * comes from its op (below), reading snapshot fields or request attributes by name and earlier columns by index;
 * then value = (log ? log1p : id)(max(raw, 0)) / scale, as float32. Ops "request", "request_missing",
 * "request_len" and "count" give one value for every row and may be referenced by any column; a replica column
 * may reference only the columns before it.
 */
#include "fastnet.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { OP_CONST, OP_VALUE, OP_FLAG, OP_MISSING, OP_CAPPED, OP_ABOVE_MIN, OP_SHARE, OP_PRODUCT,
       OP_REQUEST, OP_REQUEST_MISSING, OP_REQUEST_LEN, OP_COUNT, N_OPS };
static const struct {
    const char *name;
    int names, refs; /* how many of each it takes; names -1: one or more */
} OPS[N_OPS] = {
    [OP_CONST] = {"const", 0, 0},             /* x */
    [OP_VALUE] = {"value", 1, 0},             /* field x x (None: 0) */
    [OP_FLAG] = {"flag", 1, 0},               /* 1 if field is true */
    [OP_MISSING] = {"missing", -1, 0},        /* 1 if any field is None */
    [OP_CAPPED] = {"capped", 1, 0},           /* min(field, x), x where not finite */
    [OP_ABOVE_MIN] = {"above_min", 2, 0},     /* field - its minimum over replicas whose second field is true; 0 if false */
    [OP_SHARE] = {"share", 1, 1},             /* field / column, 0 where the column is 0 */
    [OP_PRODUCT] = {"product", 0, 2},         /* column x column */
    [OP_REQUEST] = {"request", 1, 0},         /* the request's attribute (None: 0) */
    [OP_REQUEST_MISSING] = {"request_missing", 1, 0}, /* 1 if the request's attribute is None */
    [OP_REQUEST_LEN] = {"request_len", 1, 0}, /* len(the request's attribute) */
    [OP_COUNT] = {"count", 1, 0},             /* the number of replicas whose field is true */
};
#define PER_REQUEST(op) ((op) >= OP_REQUEST)
#define MAX_NAMES 8

typedef struct {
    int op, n_in, in[MAX_NAMES], ref[2], log;
    double x, scale;
} column_t;

static struct {
    int n_cols, n_fields, n_req;
    column_t *col;
    PyObject **field; /* the snapshot fields the columns read (interned), in[] of replica ops index it */
    PyObject **req;   /* the request attributes, one per per-request column (in[0] of those indexes it) */
    PyTypeObject *type;
    Py_ssize_t *off;  /* the fields' slot offsets in `type`; snapshots of other types are read with getattr */
} prog;

static void free_refs(PyObject **names, int n)
{
    for (int i = 0; names && i < n; i++)
        Py_XDECREF(names[i]);
    PyMem_Free(names);
}

/* The index of `name` in names[0..*n), appended if new */
static int intern_index(PyObject **names, int *n, PyObject *name)
{
    for (int i = 0; i < *n; i++)
        if (PyUnicode_Compare(names[i], name) == 0)
            return i;
    names[*n] = Py_NewRef(name);
    PyUnicode_InternInPlace(&names[*n]);
    return (*n)++;
}

/* One column of the table into c; 0, or -1 with an exception set */
static int parse_column(PyObject *spec, int j, column_t *c, PyObject **field, int *n_fields, PyObject **req, int *n_req)
{
    PyObject *names, *refs;
    const char *op;
    int log;
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 6) {
        PyErr_Format(PyExc_TypeError, "bind_rows: column %d: a column is (op, names, refs, x, log, scale)", j);
        return -1;
    }
    if (!PyArg_ParseTuple(spec, "sO!O!dpd", &op, &PyTuple_Type, &names, &PyTuple_Type, &refs, &c->x, &log, &c->scale))
        return -1;
    c->log = log;
    c->op = -1;
    for (int o = 0; o < N_OPS; o++)
        if (!strcmp(op, OPS[o].name))
            c->op = o;
    if (c->op < 0) {
        PyErr_Format(PyExc_ValueError, "bind_rows: column %d: op %s is not one this extension knows (rebuild it)", j, op);
        return -1;
    }
    const Py_ssize_t nn = PyTuple_GET_SIZE(names), nr = PyTuple_GET_SIZE(refs);
    const int want = OPS[c->op].names;
    if ((want < 0 ? nn < 1 || nn > MAX_NAMES : nn != want) || nr != OPS[c->op].refs) {
        PyErr_Format(PyExc_ValueError, "bind_rows: column %d: op %s with %zd names and %zd column references", j, op, nn, nr);
        return -1;
    }
    c->n_in = (int)nn;
    for (int k = 0; k < c->n_in; k++) {
        PyObject *name = PyTuple_GET_ITEM(names, k);
        if (!PyUnicode_Check(name)) {
            PyErr_Format(PyExc_TypeError, "bind_rows: column %d: a name is not a str", j);
            return -1;
        }
        c->in[k] = PER_REQUEST(c->op) && c->op != OP_COUNT ? intern_index(req, n_req, name) : intern_index(field, n_fields, name);
    }
    for (int k = 0; k < (int)nr; k++) {
        c->ref[k] = (int)PyLong_AsLong(PyTuple_GET_ITEM(refs, k));
        if (c->ref[k] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* bind_rows(snapshot_cls, columns) -> whether snapshot_cls is read by slot (else with getattr, as any other type) */
PyObject *py_bind_rows(PyObject *self, PyObject *args)
{
    PyObject *cls, *columns;
    if (!PyArg_ParseTuple(args, "O!O!", &PyType_Type, &cls, &PyTuple_Type, &columns))
        return NULL;
    const int n = (int)PyTuple_GET_SIZE(columns), cap = n * MAX_NAMES + 1;
    column_t *col = PyMem_Calloc(n + 1, sizeof(column_t));
    PyObject **field = PyMem_Calloc(cap, sizeof(PyObject *)), **req = PyMem_Calloc(cap, sizeof(PyObject *));
    Py_ssize_t *off = NULL;
    int n_fields = 0, n_req = 0;
    if (!col || !field || !req) {
        PyErr_NoMemory();
        goto fail;
    }
    for (int j = 0; j < n; j++)
        if (parse_column(PyTuple_GET_ITEM(columns, j), j, &col[j], field, &n_fields, req, &n_req))
            goto fail;
    for (int j = 0; j < n; j++)
        for (int k = 0; k < OPS[col[j].op].refs; k++) {
            const int r = col[j].ref[k];
            if (r < 0 || r >= n || !(PER_REQUEST(col[r].op) || r < j)) {
                PyErr_Format(PyExc_ValueError, "bind_rows: column %d references column %d, neither per request nor before it", j, r);
                goto fail;
            }
        }
    off = PyMem_Calloc(n_fields + 1, sizeof(Py_ssize_t));
    if (!off) {
        PyErr_NoMemory();
        goto fail;
    }
    int by_slot = 1;
    for (int k = 0; k < n_fields && by_slot; k++) {
        off[k] = plain_slot(cls, field[k]);
        if (off[k] == -2)
            goto fail;
        by_slot = off[k] >= 0;
    }
    PyMem_Free(prog.col);
    free_refs(prog.field, prog.n_fields);
    free_refs(prog.req, prog.n_req);
    PyMem_Free(prog.off);
    prog.n_cols = n, prog.n_fields = n_fields, prog.n_req = n_req, prog.col = col, prog.field = field, prog.req = req, prog.off = off;
    Py_XSETREF(prog.type, by_slot ? (PyTypeObject *)Py_NewRef(cls) : NULL);
    return PyBool_FromLong(by_slot);
fail:
    PyMem_Free(col);
    free_refs(field, n_fields);
    free_refs(req, n_req);
    PyMem_Free(off);
    return NULL;
}

/* The value as a double; *none = 1 (and 0.0) for None. -1 with an exception set on a non-number. */
static int as_number(PyObject *x, double *v, char *none)
{
    *none = x == Py_None;
    if (*none)
        *v = 0.0;
    else if (PyFloat_CheckExact(x))
        *v = PyFloat_AS_DOUBLE(x);
    else if (x == Py_True || x == Py_False)
        *v = x == Py_True;
    else if (PyLong_CheckExact(x)) /* float(int) without the intermediate float object */
        *v = PyLong_AsDouble(x);
    else
        *v = PyFloat_AsDouble(x);
    return (*v == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* Field k of a snapshot as a double (as_number) */
static int read_field(PyObject *obj, int k, double *v, char *none)
{
    if (Py_TYPE(obj) == prog.type) {
        PyObject *x = *(PyObject **)((char *)obj + prog.off[k]);
        if (!x) {
            PyErr_SetObject(PyExc_AttributeError, prog.field[k]);
            return -1;
        }
        return as_number(x, v, none);
    }
    PyObject *x = PyObject_GetAttr(obj, prog.field[k]);
    if (!x)
        return -1;
    const int rc = as_number(x, v, none);
    Py_DECREF(x);
    return rc;
}

/* The value of per-request column c, or of an above_min column its minimum; 0, or -1 with an exception set */
static int request_value(const column_t *c, PyObject *request, const double *v, const char *none, Py_ssize_t n, double *out)
{
    const int nf = prog.n_fields;
    if (c->op == OP_COUNT || c->op == OP_ABOVE_MIN) {
        const int among = c->in[c->op == OP_COUNT ? 0 : 1];
        Py_ssize_t count = 0;
        double lo = 0.0;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (v[i * nf + among] == 0.0)
                continue;
            const double x = c->op == OP_ABOVE_MIN ? v[i * nf + c->in[0]] : 0.0;
            if (count == 0 || x < lo)
                lo = x;
            count++;
        }
        *out = c->op == OP_COUNT ? (double)count : lo;
        return 0;
    }
    PyObject *x = PyObject_GetAttr(request, prog.req[c->in[0]]);
    if (!x)
        return -1;
    int rc = 0;
    char is_none;
    if (c->op == OP_REQUEST_LEN) {
        const Py_ssize_t len = PyObject_Length(x);
        rc = len < 0 ? -1 : 0;
        *out = (double)len;
    } else if (c->op == OP_REQUEST_MISSING)
        *out = x == Py_None ? 1.0 : 0.0;
    else
        rc = as_number(x, out, &is_none);
    Py_DECREF(x);
    return rc;
}

/* build_features rows of the snapshots in `reps` for `request` into `o` float32 [len(reps), n_cols]; 0, or -1 with
 * an exception set */
static int rows_into(PyObject *reps, PyObject *request, float *o)
{
    const Py_ssize_t n = PyTuple_GET_SIZE(reps);
    const int F = prog.n_cols, nf = prog.n_fields;
    /* raw rows [n][F], the fields [n][nf], the per-request values [F]; then the fields' None flags [n][nf] */
    double *raw = malloc(sizeof(double) * ((size_t)n * (F + nf) + F + 1) + (size_t)n * nf + 1);
    if (!raw) {
        PyErr_NoMemory();
        return -1;
    }
    double *v = raw + (size_t)n * F, *fixed = v + (size_t)n * nf;
    char *none = (char *)(fixed + F);
    for (Py_ssize_t i = 0; i < n; i++)
        for (int k = 0; k < nf; k++)
            if (read_field(PyTuple_GET_ITEM(reps, i), k, &v[i * nf + k], &none[i * nf + k]))
                goto fail;
    for (int j = 0; j < F; j++)
        if ((PER_REQUEST(prog.col[j].op) || prog.col[j].op == OP_ABOVE_MIN) &&
            request_value(&prog.col[j], request, v, none, n, &fixed[j]))
            goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        double *row = raw + (size_t)i * F;
        const double *vi = v + (size_t)i * nf;
        const char *ni = none + (size_t)i * nf;
        for (int j = 0; j < F; j++)
            if (PER_REQUEST(prog.col[j].op))
                row[j] = fixed[j];
        for (int j = 0; j < F; j++) {
            const column_t *c = &prog.col[j];
            const double a = c->n_in && !PER_REQUEST(c->op) ? vi[c->in[0]] : 0.0;
            switch (c->op) {
            case OP_CONST:
                row[j] = c->x;
                break;
            case OP_VALUE:
                row[j] = a * c->x;
                break;
            case OP_FLAG:
                row[j] = a != 0.0 ? 1.0 : 0.0;
                break;
            case OP_MISSING: {
                int any = 0;
                for (int k = 0; k < c->n_in; k++)
                    any |= ni[c->in[k]];
                row[j] = any ? 1.0 : 0.0;
                break;
            }
            case OP_CAPPED:
                row[j] = isfinite(a) ? (a < c->x ? a : c->x) : c->x;
                break;
            case OP_ABOVE_MIN:
                row[j] = vi[c->in[1]] != 0.0 ? a - fixed[j] : 0.0;
                break;
            case OP_SHARE: {
                const double d = row[c->ref[0]];
                row[j] = d != 0.0 ? a / d : 0.0;
                break;
            }
            case OP_PRODUCT:
                row[j] = row[c->ref[0]] * row[c->ref[1]];
                break;
            default: /* per request: filled above */
                break;
            }
        }
        for (int j = 0; j < F; j++) {
            double x = row[j];
            x = (x > 0.0 || isnan(x)) ? x : 0.0; /* np.maximum(x, 0.0): -0.0 becomes 0.0, NaN stays */
            if (prog.col[j].log)
                x = log1p(x);
            o[i * F + j] = (float)(x / prog.col[j].scale);
        }
    }
    free(raw);
    return 0;
fail:
    free(raw);
    return -1;
}

static int check_bound(const char *what)
{
    if (prog.col)
        return 0;
    PyErr_Format(PyExc_RuntimeError, "%s: bind_rows() has not bound a column table", what);
    return -1;
}

/* rows(replicas, request, out): build_features for one view into `out` float32 [len(replicas), n_cols] */
PyObject *py_rows(PyObject *self, PyObject *args)
{
    PyObject *reps, *request;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "O!Ow*", &PyTuple_Type, &reps, &request, &out))
        return NULL;
    PyObject *res = NULL;
    if (check_bound("rows") || check_f32(&out, PyTuple_GET_SIZE(reps) * prog.n_cols, "out") ||
        rows_into(reps, request, out.buf))
        goto end;
    res = Py_NewRef(Py_None);
end:
    PyBuffer_Release(&out);
    return res;
}

/* best_view(replicas, request, weights, dims) -> (pick, finite): rows(...) and best(...) in one call,
 * with the rows in C memory. A live router's caches are cold between requests, and there allocating the numpy array
 * for the rows alone costs tens of microseconds. */
PyObject *py_best_view(PyObject *self, PyObject *args)
{
    PyObject *reps, *request, *dims_obj;
    Py_buffer wb;
    long dims[8];
    if (!PyArg_ParseTuple(args, "O!Oy*O", &PyTuple_Type, &reps, &request, &wb, &dims_obj))
        return NULL;
    PyObject *res = NULL;
    const Py_ssize_t R = PyTuple_GET_SIZE(reps);
    float *rows = NULL, *logit = NULL;
    if (check_bound("best_view"))
        goto end;
    const int F = prog.n_cols;
    if (R <= 0 || R > INT_MAX / (F + 1)) {
        PyErr_Format(PyExc_ValueError, "best_view: %zd replicas (no replicas, or more than it can index)", R);
        goto end;
    }
    if (read_longs(dims_obj, dims, 8, "dims"))
        goto end;
    if (dims[0] != F) {
        PyErr_Format(PyExc_ValueError, "best_view: the network reads %ld features, rows() makes %d", dims[0], F);
        goto end;
    }
    rows = malloc(sizeof(float) * (size_t)R * (F + 1));
    if (!rows) {
        PyErr_NoMemory();
        goto end;
    }
    logit = rows + (size_t)R * F;
    if (rows_into(reps, request, rows) ||
        run_logits(rows, (int)R, dims, wb.buf, (size_t)wb.len / sizeof(float), logit))
        goto end;
    int pick, finite;
    pick_best(logit, rows, (int)R, F, cross_mask_column(), &pick, &finite);
    res = Py_BuildValue("(iO)", pick, finite ? Py_True : Py_False);
end:
    free(rows);
    PyBuffer_Release(&wb);
    return res;
}
