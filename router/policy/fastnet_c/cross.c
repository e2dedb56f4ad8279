/* model_inputs of one decision (router/policy/cross_inputs.py is the reference, in numpy): the build_features rows,
 * then each replica column against the valid replicas' minimum, mean and maximum; the derived inputs, each
 * log(1 + program) / 10 and against its minimum; is-minimum / is-maximum indicators of both; the excess inputs.
 * A replica is valid where its mask column is > 0.5.
 *
 * bind_inputs(n_features, n_replica, mask_column, programs, excess): the cross-replica inputs of the feature table
 * (router/policy/feature_binding.py passes them when it loads). programs: one per derived input, its operations in
 * postfix order, each (op, column, x); excess: one (derived input, offset) per excess input. Nothing here knows an
 * input by name or position.
 */
#include "fastnet.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { T_FEATURE, T_UNLOGGED, T_CONST, T_ADD, T_SUB, T_MUL, T_DIV, T_RELATIVE, N_TERM_OPS };
static const struct {
    const char *name;
    int pops; /* operands taken from the stack; every operation pushes one result */
} TERM_OPS[N_TERM_OPS] = {
    [T_FEATURE] = {"feature", 0},   /* the row's value in column `column` */
    [T_UNLOGGED] = {"unlogged", 0}, /* expf(the row's value in `column` x x) - 1: a log1p column's value back, x its scale */
    [T_CONST] = {"const", 0},       /* x */
    [T_ADD] = {"add", 2},
    [T_SUB] = {"sub", 2},
    [T_MUL] = {"mul", 2},
    [T_DIV] = {"div", 2},
    [T_RELATIVE] = {"relative", 1}, /* a / max(its mean over the valid replicas where it is > 0, 1e-6); 1 elsewhere */
};
#define MAX_DEPTH 16

typedef struct {
    int op, col, slot; /* slot: an unlogged column's row in the block cross_inputs unlogs once per call */
    float x;
} instr_t;

static struct {
    int n_features, n_rep, mask_col, n_derived, n_excess, depth;
    instr_t *code;  /* every derived input's program, one after the other; NULL until bound */
    int *start;     /* derived input i: code[start[i] .. start[i + 1]) */
    int *of;        /* excess input k: (raw of derived input of[k] - its minimum) / (its mean + offset[k]) */
    float *offset;
    int n_unlog;    /* the distinct (column, scale) pairs the programs read unlogged */
    instr_t *unlog; /* one T_UNLOGGED instruction per pair */
} cx;

/* One program (a tuple of (op, column, x)) appended to code at *n_code; its deepest stack into *depth. 0, or -1 with
 * an exception set */
static int parse_program(PyObject *prog, int i, int F, instr_t *code, int *n_code, int cap, int *depth, instr_t *unlog,
                         int *n_unlog)
{
    if (!PyTuple_Check(prog) || PyTuple_GET_SIZE(prog) < 1 || *n_code + PyTuple_GET_SIZE(prog) > cap) {
        PyErr_Format(PyExc_TypeError, "bind_inputs: derived input %d: a program is a non-empty tuple of (op, column, x)", i);
        return -1;
    }
    int sp = 0;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(prog); k++) {
        const char *op;
        instr_t *in = &code[(*n_code)++];
        double x;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(prog, k), "sid", &op, &in->col, &x))
            return -1;
        in->x = (float)x;
        in->op = -1;
        for (int o = 0; o < N_TERM_OPS; o++)
            if (!strcmp(op, TERM_OPS[o].name))
                in->op = o;
        if (in->op < 0) {
            PyErr_Format(PyExc_ValueError, "bind_inputs: derived input %d: operation %s is not one this extension knows (rebuild it)",
                         i, op);
            return -1;
        }
        if ((in->op == T_FEATURE || in->op == T_UNLOGGED) && (in->col < 0 || in->col >= F)) {
            PyErr_Format(PyExc_ValueError, "bind_inputs: derived input %d reads column %d of rows %d wide", i, in->col, F);
            return -1;
        }
        if (in->op == T_UNLOGGED) {
            in->slot = *n_unlog;
            for (int u = 0; u < *n_unlog; u++)
                if (unlog[u].col == in->col && unlog[u].x == in->x)
                    in->slot = u;
            if (in->slot == *n_unlog)
                unlog[(*n_unlog)++] = *in;
        }
        if (sp < TERM_OPS[in->op].pops) {
            PyErr_Format(PyExc_ValueError, "bind_inputs: derived input %d: %s without its operands", i, op);
            return -1;
        }
        sp += 1 - TERM_OPS[in->op].pops;
        if (sp > MAX_DEPTH) {
            PyErr_Format(PyExc_ValueError, "bind_inputs: derived input %d needs more than %d operands at once", i, MAX_DEPTH);
            return -1;
        }
        *depth = sp > *depth ? sp : *depth;
    }
    if (sp != 1) {
        PyErr_Format(PyExc_ValueError, "bind_inputs: derived input %d leaves %d values, not one", i, sp);
        return -1;
    }
    return 0;
}

/* bind_inputs(n_features, n_replica, mask_column, programs, excess) */
PyObject *py_bind_inputs(PyObject *self, PyObject *args)
{
    int F, n, mask;
    PyObject *programs, *excess;
    if (!PyArg_ParseTuple(args, "iiiO!O!", &F, &n, &mask, &PyTuple_Type, &programs, &PyTuple_Type, &excess))
        return NULL;
    if (n < 1 || n > F || mask < 0 || mask >= F) {
        PyErr_Format(PyExc_ValueError, "bind_inputs: %d replica columns and mask column %d in rows %d wide", n, mask, F);
        return NULL;
    }
    const int d = (int)PyTuple_GET_SIZE(programs), e = (int)PyTuple_GET_SIZE(excess);
    int cap = 0, n_code = 0, depth = 1, n_unlog = 0;
    for (int i = 0; i < d; i++)
        cap += PyTuple_Check(PyTuple_GET_ITEM(programs, i)) ? (int)PyTuple_GET_SIZE(PyTuple_GET_ITEM(programs, i)) : 0;
    instr_t *code = PyMem_Calloc(cap + 1, sizeof(instr_t));
    int *start = PyMem_Calloc(d + 1, sizeof(int)), *of = PyMem_Calloc(e + 1, sizeof(int));
    float *offset = PyMem_Calloc(e + 1, sizeof(float));
    instr_t *unlog = PyMem_Calloc(cap + 1, sizeof(instr_t));
    if (!code || !start || !of || !offset || !unlog) {
        PyErr_NoMemory();
        goto fail;
    }
    for (int i = 0; i < d; i++) {
        start[i] = n_code;
        if (parse_program(PyTuple_GET_ITEM(programs, i), i, F, code, &n_code, cap, &depth, unlog, &n_unlog))
            goto fail;
    }
    start[d] = n_code;
    for (int k = 0; k < e; k++) {
        double off;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(excess, k), "id", &of[k], &off))
            goto fail;
        offset[k] = (float)off;
        if (of[k] < 0 || of[k] >= d) {
            PyErr_Format(PyExc_ValueError, "bind_inputs: excess input %d of derived input %d, of %d", k, of[k], d);
            goto fail;
        }
    }
    PyMem_Free(cx.code);
    PyMem_Free(cx.start);
    PyMem_Free(cx.of);
    PyMem_Free(cx.offset);
    PyMem_Free(cx.unlog);
    cx.n_features = F, cx.n_rep = n, cx.mask_col = mask, cx.n_derived = d, cx.n_excess = e, cx.depth = depth;
    cx.code = code, cx.start = start, cx.of = of, cx.offset = offset, cx.n_unlog = n_unlog, cx.unlog = unlog;
    Py_RETURN_NONE;
fail:
    PyMem_Free(code);
    PyMem_Free(start);
    PyMem_Free(of);
    PyMem_Free(offset);
    PyMem_Free(unlog);
    return NULL;
}

/* The model input width the bound table makes of rows F wide; -1 with an exception set if none is bound, or F is
 * another width */
static int cross_width(int F, const char *what)
{
    if (!cx.code) {
        PyErr_Format(PyExc_RuntimeError, "%s: bind_inputs() has not bound the cross-replica inputs", what);
        return -1;
    }
    if (F != cx.n_features) {
        PyErr_Format(PyExc_ValueError, "%s: rows of %d features, the bound feature table makes %d", what, F, cx.n_features);
        return -1;
    }
    const int n = cx.n_rep, d = cx.n_derived;
    return F + 3 * n + 2 * d + 2 * (n + d) + cx.n_excess;
}

int cross_mask_column(void) { return cx.mask_col; }

/* Derived input i of every replica into s[0 .. R) (stack: room for cx.depth arrays of R, s the first; u: the
 * unlogged columns, [cx.n_unlog][R]) */
static void run_program(int i, const float *f, int R, int F, const float *valid, const float *u, float *s)
{
    int sp = 0;
    for (const instr_t *in = cx.code + cx.start[i]; in < cx.code + cx.start[i + 1]; in++) {
        float *top = s + (size_t)sp * R; /* the next free slot; the operands are the slots below it */
        float *a = TERM_OPS[in->op].pops == 2 ? top - 2 * (size_t)R : NULL, *b = TERM_OPS[in->op].pops ? top - R : NULL;
        switch (in->op) {
        case T_FEATURE:
            for (int r = 0; r < R; r++)
                top[r] = f[(size_t)r * F + in->col];
            break;
        case T_UNLOGGED:
            memcpy(top, u + (size_t)in->slot * R, sizeof(float) * R);
            break;
        case T_CONST:
            for (int r = 0; r < R; r++)
                top[r] = in->x;
            break;
        case T_ADD:
            for (int r = 0; r < R; r++)
                a[r] = a[r] + b[r];
            break;
        case T_SUB:
            for (int r = 0; r < R; r++)
                a[r] = a[r] - b[r];
            break;
        case T_MUL:
            for (int r = 0; r < R; r++)
                a[r] = a[r] * b[r];
            break;
        case T_DIV:
            for (int r = 0; r < R; r++)
                a[r] = a[r] / b[r];
            break;
        case T_RELATIVE: {
            float sum = 0.0f;
            int count = 0;
            for (int r = 0; r < R; r++)
                if (valid[r] > 0.5f && b[r] > 0.0f) {
                    sum += b[r];
                    count++;
                }
            const float mean = sum / (float)(count > 1 ? count : 1);
            const float ref = mean > 1e-6f ? mean : 1e-6f;
            for (int r = 0; r < R; r++)
                b[r] = (valid[r] > 0.5f && b[r] > 0.0f) ? b[r] / ref : 1.0f;
            break;
        }
        }
        sp += 1 - TERM_OPS[in->op].pops;
    }
}

/* model_inputs of the rows f [R][F] into out [R][C]; 0, or -1 with an exception set */
int cross_inputs(const float *f, int R, int F, float *out, int C, const char *what)
{
    const int width = cross_width(F, what);
    if (width < 0)
        return -1;
    if (C != width) {
        PyErr_Format(PyExc_ValueError, "%s: %d model inputs, the bound feature table makes %d", what, C, width);
        return -1;
    }
    const int n = cx.n_rep, d = cx.n_derived, e = cx.n_excess, nx = n + d + e, k_ind = 3 * n + 2 * d;
    float *x = malloc(sizeof(float) * ((size_t)R * nx + 3 * (size_t)nx + (size_t)(cx.depth + 1 + cx.n_unlog) * R));
    if (!x) {
        PyErr_NoMemory();
        return -1;
    }
    float *lo = x + (size_t)R * nx, *hi = lo + nx, *mean = hi + nx, *valid = mean + nx, *u = valid + R;
    float *s = u + (size_t)cx.n_unlog * R;
    for (int k = 0; k < cx.n_unlog; k++) /* each once, however many programs read it */
        for (int r = 0; r < R; r++)
            u[(size_t)k * R + r] = expf(f[(size_t)r * F + cx.unlog[k].col] * cx.unlog[k].x) - 1.0f;
    int n_valid = 0;
    for (int r = 0; r < R; r++) {
        const float *row = f + (size_t)r * F;
        valid[r] = row[cx.mask_col] > 0.5f ? 1.0f : 0.0f;
        n_valid += row[cx.mask_col] > 0.5f;
        memcpy(x + (size_t)r * nx, row, sizeof(float) * n);
    }
    for (int i = 0; i < d; i++) {
        run_program(i, f, R, F, valid, u, s);
        for (int r = 0; r < R; r++) {
            float *xr = x + (size_t)r * nx;
            xr[n + i] = logf(s[r] + 1.0f) / 10.0f;
            for (int k = 0; k < e; k++)
                if (cx.of[k] == i)
                    xr[n + d + k] = s[r];
        }
    }
    for (int j = 0; j < nx; j++) {
        float l = INFINITY, h = -INFINITY, sum = 0.0f;
        for (int r = 0; r < R; r++) {
            if (!(valid[r] > 0.5f))
                continue;
            const float v = x[(size_t)r * nx + j];
            l = v < l ? v : l;
            h = v > h ? v : h;
            sum += v;
        }
        if (n_valid < R) { /* the masked statistics fill masked rows with +-1e4 (as the network was trained) */
            l = l < 1e4f ? l : 1e4f;
            h = h > -1e4f ? h : -1e4f;
        }
        lo[j] = n_valid ? l : 0.0f;
        hi[j] = n_valid ? h : 0.0f;
        mean[j] = sum / (float)(n_valid > 1 ? n_valid : 1);
    }
    for (int r = 0; r < R; r++) {
        const float *row = f + (size_t)r * F;
        const float *xr = x + (size_t)r * nx;
        float *o = out + (size_t)r * C;
        memcpy(o, row, sizeof(float) * F);
        float *c = o + F;
        if (!(valid[r] > 0.5f)) {
            memset(c, 0, sizeof(float) * (C - F));
            continue;
        }
        for (int j = 0; j < n; j++) {
            c[j] = xr[j] - lo[j];
            c[n + j] = xr[j] - mean[j];
            c[2 * n + j] = hi[j] - xr[j];
        }
        for (int j = 0; j < d; j++) {
            c[3 * n + j] = xr[n + j];
            c[3 * n + d + j] = xr[n + j] - lo[n + j];
        }
        for (int j = 0; j < n + d; j++) {
            c[k_ind + j] = xr[j] <= lo[j] + 1e-6f ? 1.0f : 0.0f;
            c[k_ind + n + d + j] = xr[j] >= hi[j] - 1e-6f ? 1.0f : 0.0f;
        }
        for (int k = 0; k < e; k++)
            c[k_ind + 2 * (n + d) + k] = (xr[n + d + k] - lo[n + d + k]) / (mean[n + d + k] + cx.offset[k]);
    }
    free(x);
    return 0;
}

/* inputs(rows, n_rows, out): out = model_inputs(rows, mask column), float32 */
PyObject *py_inputs(PyObject *self, PyObject *args)
{
    Py_buffer rows, out;
    int R;
    if (!PyArg_ParseTuple(args, "y*iw*", &rows, &R, &out))
        return NULL;
    PyObject *res = NULL;
    if (R < 0) {
        PyErr_SetString(PyExc_ValueError, "inputs: a negative number of rows");
        goto end;
    }
    const int F = R ? (int)(rows.len / sizeof(float) / R) : 0;
    const int C = R ? (int)(out.len / sizeof(float) / R) : 0;
    if (R && (check_f32(&rows, (Py_ssize_t)R * F, "rows") || check_f32(&out, (Py_ssize_t)R * C, "out") ||
              cross_inputs(rows.buf, R, F, out.buf, C, "inputs")))
        goto end;
    res = Py_NewRef(Py_None);
end:
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    return res;
}
