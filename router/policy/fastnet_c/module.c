/* router.policy._fastnet: the module's method table (fastnet.h lists the sources and their entry points). */
#include "fastnet.h"

static PyMethodDef methods[] = {
    {"bind_inputs", py_bind_inputs, METH_VARARGS,
     "bind_inputs(n_features, n_replica, mask_column, programs, excess): inputs()'s cross-replica inputs"},
    {"inputs", py_inputs, METH_VARARGS, "inputs(rows, n_rows, out): model_inputs of one decision"},
    {"logits", py_logits, METH_VARARGS, "logits(rows, n_rows, weights, dims, out): one decision"},
    {"best", py_best, METH_VARARGS, "best(rows, n_rows, weights, dims) -> (pick, finite): one decision"},
    {"bind_view", py_bind_view, METH_VARARGS,
     "bind_view(snapshot_cls, tracker_cls, sources) -> None, or the first field not a plain slot: snapshots()'s table"},
    {"snapshots", py_snapshots, METH_VARARGS, "snapshots(trackers, now_s, matches): ClusterTracker.view's snapshots"},
    {"bind_rows", py_bind_rows, METH_VARARGS,
     "bind_rows(snapshot_cls, columns) -> whether snapshot_cls is read by slot: rows()'s column table"},
    {"rows", py_rows, METH_VARARGS, "rows(replicas, request, out): build_features of one view"},
    {"best_view", py_best_view, METH_VARARGS,
     "best_view(replicas, request, weights, dims) -> (pick, finite): rows() and best() in one call"},
    {"chain_blocks", py_chain_blocks, METH_VARARGS,
     "chain_blocks(data, block, n) -> the chained hashes of data's first n blocks (router.policy.estimate.chain_hash)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastnet", "The routing network for one decision, in C.", -1, methods};

PyMODINIT_FUNC PyInit__fastnet(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "ALIGN_FLOATS", ALIGN)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
