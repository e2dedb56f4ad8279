/* router.policy._fastnet: one extension built from the sources in this folder (setup.py lists them).
 *
 *   network.c  the routing network's forward pass for one decision
 *   cross.c    the cross-replica inputs (model_inputs), by the programs feature_binding.py binds from the table
 *   views.c    ClusterTracker.view's snapshots, built from the trackers
 *   rows.c     build_features rows, from the snapshots, by the column table feature_binding.py binds
 *   prefix.c   router.policy.estimate's chained prefix-block hashes (BLAKE2b)
 *   module.c   the module: its method table and constants
 *
 * Nothing here knows a feature or a snapshot field by name or position: router/policy/feature_binding.py and
 * router/policy/tracking.py pass their tables when they bind (bind_rows, bind_inputs, bind_view).
 */
#ifndef ROUTEWISE_FASTNET_H
#define ROUTEWISE_FASTNET_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* ---- entry points: the module's methods ---- */

/* network.c */
PyObject *py_logits(PyObject *self, PyObject *args);  /* logits(rows, n_rows, weights, dims, out) */
PyObject *py_best(PyObject *self, PyObject *args);    /* best(rows, n_rows, weights, dims) */
/* cross.c */
PyObject *py_bind_inputs(PyObject *self, PyObject *args); /* bind_inputs(n_features, n_replica, mask_column, programs, excess) */
PyObject *py_inputs(PyObject *self, PyObject *args);      /* inputs(rows, n_rows, out) */
/* views.c */
PyObject *py_bind_view(PyObject *self, PyObject *args); /* bind_view(snapshot_cls, tracker_cls, sources) */
PyObject *py_snapshots(PyObject *self, PyObject *args); /* snapshots(trackers, now_s, matches) */
/* rows.c */
PyObject *py_bind_rows(PyObject *self, PyObject *args); /* bind_rows(snapshot_cls, columns) */
PyObject *py_rows(PyObject *self, PyObject *args);      /* rows(replicas, request, out) */
PyObject *py_best_view(PyObject *self, PyObject *args); /* best_view(replicas, request, weights, dims) */
/* prefix.c */
PyObject *py_chain_blocks(PyObject *self, PyObject *args); /* chain_blocks(data, block, n) */

/* ---- shared between the sources ---- */

/* Every array of the weight blob starts on a 64-byte boundary: ALIGN floats (fastnet.py pads to it) */
#define ALIGN 16

/* network.c: the logits of one decision into out [R] (0, or -1 with an exception set); the first largest logit
 * among rows whose column `col` is > 0.5 and whether all of theirs are finite */
int run_logits(const float *rows, int R, const long *dims, const float *wb, size_t wn, float *out);
void pick_best(const float *logit, const float *rows, int R, int width, int col, int *pick_out, int *finite_out);
int read_longs(PyObject *seq, long *dst, int n, const char *what);
int check_f32(Py_buffer *b, Py_ssize_t n, const char *what);

/* cross.c: model_inputs of rows f [R][F] into out [R][C] by the bound table (0, or -1 with an exception set naming
 * `what`: nothing bound, or rows or inputs of other widths); the mask column, once cross_inputs has succeeded */
int cross_inputs(const float *f, int R, int F, float *out, int C, const char *what);
int cross_mask_column(void);

/* views.c: the offset of a plain object slot `name` of cls; -1 (no exception) if it is missing or anything
 * else, -2 with an exception set if looking it up failed otherwise */
Py_ssize_t plain_slot(PyObject *cls, PyObject *name);

#endif
