/* router.policy._fastnet: one extension built from the sources in this folder (setup.py lists them).
 *
 *   network.c  the routing network's forward pass for one decision, and the cross-replica inputs
 *   views.c    ClusterTracker.view's snapshots, built from the trackers
 *   rows.c     build_features rows, from the snapshots, by the column table features.py binds
 *   shared.c   router.shared's host-wide in-flight sums
 *   prefix.c   router.policy.estimate's chained prefix-block hashes (BLAKE2b)
 *   module.c   the module: its method table and constants
 *
 * Nothing here knows a feature or a snapshot field by name or position: router/policy/features.py and
 * router/policy/tracking.py pass their tables when they bind (bind_rows, bind_view).
 */
#ifndef ROUTEWISE_FASTNET_H
#define ROUTEWISE_FASTNET_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* ---- entry points: the module's methods ---- */

/* network.c */
PyObject *py_inputs(PyObject *self, PyObject *args);  /* inputs(rows, n_rows, spec_i, spec_f, out) */
PyObject *py_logits(PyObject *self, PyObject *args);  /* logits(rows, n_rows, spec_i, spec_f, weights, dims, out) */
PyObject *py_best(PyObject *self, PyObject *args);    /* best(rows, n_rows, spec_i, spec_f, weights, dims) */
/* views.c */
PyObject *py_bind_view(PyObject *self, PyObject *args); /* bind_view(snapshot_cls, tracker_cls, sources) */
PyObject *py_snapshots(PyObject *self, PyObject *args); /* snapshots(trackers, now_s, matches) */
/* rows.c */
PyObject *py_bind_rows(PyObject *self, PyObject *args); /* bind_rows(snapshot_cls, columns) */
PyObject *py_rows(PyObject *self, PyObject *args);      /* rows(replicas, request, out) */
PyObject *py_best_view(PyObject *self, PyObject *args); /* best_view(replicas, request, spec_i, spec_f, weights, dims) */
/* shared.c */
PyObject *py_sum_rows(PyObject *self, PyObject *args);  /* sum_rows(counters, workers, per_worker, fields, ncols) */
PyObject *py_put_row(PyObject *self, PyObject *args);   /* put_row(counters, offset, values) */
/* prefix.c */
PyObject *py_chain_blocks(PyObject *self, PyObject *args); /* chain_blocks(data, block, n) */

/* ---- shared between the sources ---- */

/* spec_i: n_rep, healthy_col, match_frac_col, unlog_cols[5] (prompt, decode, tpot_ms, awaiting, req_prompt)
 * spec_f: unlog_scales[5], wait_decode_weight (router/policy/fastnet.py builds both from features.py) */
enum { SI_NREP, SI_HEALTHY, SI_MATCH, SI_UNLOG, SI_LEN = SI_UNLOG + 5 };
enum { SF_SCALES, SF_DECODE_W = SF_SCALES + 5, SF_LEN };
/* Every array of the weight blob starts on a 64-byte boundary: ALIGN floats (fastnet.py pads to it) */
#define ALIGN 16

/* network.c: the logits of one decision into out [R] (0, or -1 with an exception set); the first largest logit
 * among rows whose column `col` is > 0.5 and whether all of theirs are finite */
int run_logits(const float *rows, int R, const long *si, const float *sf, const long *dims, const float *wb, size_t wn,
               float *out);
void pick_best(const float *logit, const float *rows, int R, int width, int col, int *pick_out, int *finite_out);
int read_longs(PyObject *seq, long *dst, int n, const char *what);
int check_f32(Py_buffer *b, Py_ssize_t n, const char *what);

/* views.c: the offset of a plain object slot `name` of cls; -1 (no exception) if it is missing or anything
 * else, -2 with an exception set if looking it up failed otherwise */
Py_ssize_t plain_slot(PyObject *cls, PyObject *name);

#endif
