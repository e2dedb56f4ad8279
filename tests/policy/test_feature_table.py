"""One table drives every model input: router/policy/feature_table.py's REPLICA_COLUMNS / REQUEST_COLUMNS, which the
Python row builder follows (generated from it) and the C builder receives when it binds (_fastnet.bind_rows), and its
cross-replica inputs (DERIVED_INPUTS, EXCESS_INPUTS), which model_inputs evaluates in numpy and the C extension
receives as programs when it binds (_fastnet.bind_inputs).

The main test adds features to the table in a copy of the package (one from a snapshot field no column read yet,
one from a new snapshot field with the tracker slot that fills it, and a cross-replica input over them with an
excess input of it), builds the extension there from the same, untouched C sources with the same build command, and
shows the C and Python rows agree, and the C and numpy model inputs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from routewise_vllm.router.policy import feature_binding, feature_rows, features
from routewise_vllm.router.policy.features import (
    COLUMNS,
    DERIVED_INPUTS,
    EXCESS_INPUTS,
    REPLICA_COLUMNS,
    Column,
    Derived,
    Excess,
    Source,
    Term,
    check_cross,
    check_table,
    compiled_columns,
    compiled_inputs,
    feature,
    model_inputs,
    relative,
    unlogged,
    value,
)
from tests.ci import require_compiled_views, skip_or_fail

ROOT = Path(__file__).resolve().parents[2]

# Edits to the copy: (file, text, replacement), each text found exactly once.
NEW_FEATURES = [
    ("router/policy/types.py",  # the new value's declaration: a snapshot field
     "    tpot_floor_s: float | None = None",
     "    tpot_floor_s: float | None = None\n    backlog_s: float | None = None  # a new field"),
    ("router/policy/tracking.py",  # and the tracker slot it is copied from
     '"_tpot_low", "_tpot_samples",',
     '"_tpot_low", "_tpot_samples", "backlog_s",'),
    ("router/policy/tracking.py",
     "        self._tpot_samples = 0\n",
     "        self._tpot_samples = 0\n        self.backlog_s: float | None = None\n"),
    ("router/policy/feature_table.py",  # three rows of the table
     "\n)\nREQUEST_COLUMNS",
     '\n    Column("tpot_floor_ms", value("tpot_floor_s", times=1000.0), "log1p", 5.0),'
     '\n    Column("backlog_s", capped("backlog_s", 60.0), "log1p", 3.0),'
     '\n    Column("backlog_missing", missing("backlog_s", "tpot_floor_s"), "lin", 1.0),'
     "\n)\nREQUEST_COLUMNS"),
    ("router/policy/feature_table.py",  # a cross-replica input over them, every operation of a term used
     "\n)\nEXCESS_INPUTS",
     '\n    Derived("backlog_wait", (unlogged("backlog_s") * (2.0 - feature("backlog_missing")) + unlogged("outstanding"))'
     '\n            * relative(unlogged("tpot_floor_ms")) / 4.0),'
     "\n)\nEXCESS_INPUTS"),
    ("router/policy/feature_table.py",  # and its excess over the fleet
     "offset=256.0),  # in units of the mean load\n",
     "offset=256.0),  # in units of the mean load\n"
     '    Excess("backlog_wait_excess", of="backlog_wait", offset=16.0),\n'),
]

CHECK = r"""
import json, sys
import numpy as np
from routewise_vllm import router
from routewise_vllm.router.policy import fastnet, feature_rows, features, tracking
from routewise_vllm.router.policy.tracking import ClusterTracker
from routewise_vllm.router.policy.types import RequestInfo

assert router.__file__.startswith(sys.argv[1]), router.__file__  # the copy, not the checkout
assert feature_rows._compiled is not None and tracking._compiled is not None
rng = np.random.default_rng(0)
cluster = ClusterTracker([f"r{i}" for i in range(12)], prefix_block_tokens=16)
compiled = feature_rows._compiled
same, views, seen_backlog, seen_floor, wrong = True, 0, set(), False, 0
new = [features.FEATURE_NAMES.index(n) for n in ("tpot_floor_ms", "backlog_s", "backlog_missing")]
names = features.MODEL_INPUT_NAMES
healthy, n_rep, n_derived = names.index("healthy"), len(features.REPLICA_COLUMNS), len(features.DERIVED_INPUTS)
indicators = slice(features.N_FEATURES + 3 * n_rep + 2 * n_derived, -len(features.EXCESS_INPUTS))
inputs_apart, indicators_same, cross_wrong, masked_views = 0, True, 0, 0


def reference(r):  # the three new columns, written out by hand
    floor = 0.0 if r.tpot_floor_s is None else r.tpot_floor_s * 1000.0
    backlog = 60.0 if r.backlog_s is None or not np.isfinite(r.backlog_s) else min(r.backlog_s, 60.0)
    backlog = 0.0 if r.backlog_s is None else backlog
    gone = r.backlog_s is None or r.tpot_floor_s is None
    return np.array([np.log1p(max(floor, 0.0)) / 5.0, np.log1p(max(backlog, 0.0)) / 3.0, float(gone)], np.float32)


def cross_reference(rows):  # the new cross-replica input and its excess, written out by hand (float64)
    col = lambda n: rows[:, names.index(n)].astype(np.float64)
    unlog = lambda n, scale: np.exp(col(n) * scale) - 1.0
    valid = col("healthy") > 0.5
    floor = unlog("tpot_floor_ms", 5.0)
    measured = valid & (floor > 0)
    mean = max(floor[measured].sum() / max(measured.sum(), 1), 1e-6)
    raw = ((unlog("backlog_s", 3.0) * (2.0 - col("backlog_missing")) + unlog("outstanding", 3.0))
           * np.where(measured, floor / mean, 1.0) / 4.0)
    excess = (raw - raw[valid].min()) / (raw[valid].mean() + 16.0) if valid.any() else raw
    return np.where(valid, np.log1p(raw) / 10.0, 0.0), np.where(valid, excess, 0.0)


for step in range(300):
    req = RequestInfo(f"q{step}", int(rng.integers(1, 4000)), None if step % 3 else 64,
                      tuple(int(x) for x in rng.integers(0, 8, int(rng.integers(0, 5)))))
    view = cluster.view(step * 0.1, req)  # built in C, the new field included
    got = features.build_features(view, req)
    feature_rows._compiled = None
    want = features.build_features(view, req)
    feature_rows._compiled = compiled
    same &= got.tobytes() == want.tobytes()
    wrong += sum(not np.array_equal(row[new], reference(r)) for row, r in zip(got, view.replicas))
    c_inputs, np_inputs = fastnet.inputs(got), features.model_inputs(got, got[:, healthy])
    inputs_apart += not np.allclose(c_inputs, np_inputs, rtol=2e-6, atol=2e-6)
    indicators_same &= np.array_equal(c_inputs[:, indicators], np_inputs[:, indicators])
    value, excess = cross_reference(got)
    cross_wrong += not np.allclose(np_inputs[:, names.index("backlog_wait")], value, rtol=1e-5, atol=1e-6)
    cross_wrong += not np.allclose(np_inputs[:, names.index("backlog_wait_excess")], excess, rtol=1e-5, atol=1e-6)
    masked_views += bool((got[:, healthy] == 0).any())
    views += 1
    i = int(rng.integers(0, 12))
    cluster.dispatch(i, req)
    t = cluster.trackers[int(rng.integers(0, 12))]
    t.backlog_s = [None, float(rng.exponential(30.0)), float("inf"), float("nan")][step % 4]
    seen_backlog |= {v.backlog_s is None for v in view.replicas}
    seen_floor |= any(v.tpot_floor_s is not None for v in view.replicas)
    if step % 5 == 0:
        cluster.trackers[i].on_first_token(req.request_id, 0.1)
    cluster.trackers[i].on_complete(req.request_id, float(rng.uniform(0.005, 0.05)))
    cluster.trackers[int(rng.integers(0, 12))].healthy = bool(step % 3)
print(json.dumps({"same": bool(same), "wrong": int(wrong), "views": views, "names": features.FEATURE_NAMES,
                  "seen_backlog": sorted(seen_backlog), "seen_floor": bool(seen_floor), "inputs": list(names),
                  "inputs_apart": inputs_apart, "indicators_same": bool(indicators_same), "cross_wrong": int(cross_wrong),
                  "masked_views": masked_views}))
"""


def _edit(root: Path, rel: str, text: str, replacement: str) -> None:
    path = root / rel
    source = path.read_text()
    assert source.count(text) == 1, f"{rel}: the test's anchor {text!r} is not there once"
    path.write_text(source.replace(text, replacement))


def test_new_features_and_a_new_cross_replica_input_are_built_alike_in_c_and_python_without_touching_c(tmp_path):
    require_compiled_views()
    copy = tmp_path / "routewise"
    shutil.copytree(ROOT / "router", copy / "router", ignore=shutil.ignore_patterns("*.so", "__pycache__", "models"))
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(ROOT / name, copy / name)
    for rel, text, replacement in NEW_FEATURES:
        _edit(copy, rel, text, replacement)
    c_sources = sorted(p.relative_to(copy) for p in (copy / "router/policy/fastnet_c").iterdir())
    assert c_sources and all((copy / p).read_bytes() == (ROOT / p).read_bytes() for p in c_sources)  # C untouched
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=copy, capture_output=True,
                           text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    if not list((copy / "router/policy").glob("_fastnet*.so")):
        skip_or_fail(f"the C extension did not build in the copy: {build.stderr[-500:]}")
    namespace = copy / "path" / "routewise_vllm"  # the import name the package maps router/ to
    namespace.mkdir(parents=True)
    (namespace / "router").symlink_to(copy / "router")
    run = subprocess.run([sys.executable, "-c", CHECK, str(copy)], cwd=copy, env={"PYTHONPATH": str(copy / "path"), "PATH": ""},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    n = len(features.FEATURE_NAMES)
    assert out["names"][: len(REPLICA_COLUMNS)] == list(features.FEATURE_NAMES[: len(REPLICA_COLUMNS)])
    added = out["names"][len(REPLICA_COLUMNS): len(REPLICA_COLUMNS) + 3]
    assert added == ["tpot_floor_ms", "backlog_s", "backlog_missing"]
    assert len(out["names"]) == n + 3
    assert out["same"] and out["views"] == 300  # C and Python: the same bytes on every view
    assert out["wrong"] == 0  # and the new columns hold what their rows of the table say
    assert out["seen_backlog"] == [False, True] and out["seen_floor"]  # the new values did vary, None included
    # the cross-replica input and its excess: in the model's input, computed alike by C and numpy, as written
    inputs = out["inputs"]
    assert len(inputs) == len(features.MODEL_INPUT_NAMES) + 3 * 6 + 4 + 1  # new: 3 columns x 6, 1 derived x 4, 1 excess
    for name in ("backlog_wait", "backlog_wait_above_min", "is_min_backlog_wait", "is_max_backlog_wait"):
        assert name in inputs
    assert inputs[-2:] == ["token_load_excess", "backlog_wait_excess"]
    assert out["inputs_apart"] == 0 and out["indicators_same"]
    assert out["cross_wrong"] == 0 and out["masked_views"] > 50  # and with masked (unhealthy) replicas


def test_the_table_is_checked_at_import_naming_the_column():
    check_table()
    bad = [
        (Column("x", Source("cube", ("outstanding",)), "lin", 1.0), "unknown op 'cube'"),
        (Column("x", value("outstanding_tokens"), "lin", 1.0), "ReplicaSnapshot has no 'outstanding_tokens'"),
        (Column("x", Source("request", ("prompt",)), "lin", 1.0), "RequestInfo has no 'prompt'"),
        (Column("x", Source("share", ("outstanding",), ("later",)), "lin", 1.0), "'later' is neither per request nor"),
        (Column("x", value("outstanding"), "sqrt", 1.0), "transform 'sqrt'"),
        (Column("present", value("outstanding"), "lin", 1.0), "listed twice"),
    ]
    for column, message in bad:
        with pytest.raises(ValueError, match=message):
            check_table(COLUMNS + (column,))


def test_the_extension_refuses_a_table_it_cannot_follow():
    """What bind_rows checks itself (it reads memory by these indices): ops, arities, references."""
    compiled = require_compiled_views()
    from routewise_vllm.router.policy.types import ReplicaSnapshot

    good = compiled_columns()
    try:
        for table, message in [
            (good + (("cube", ("outstanding",), (), 1.0, False, 1.0),), "op cube is not one this extension knows"),
            (good + (("value", (), (), 1.0, False, 1.0),), "op value with 0 names"),
            (good[:1] + (("product", (), (0, 5), 1.0, False, 1.0),) + good[1:], "references column 5"),
            (good + (("value", ("outstanding",)),), "a column is"),
        ]:
            with pytest.raises((ValueError, TypeError), match=message):
                compiled.bind_rows(ReplicaSnapshot, table)
    finally:  # the good table back whatever happened, without hiding what did
        restored = compiled.bind_rows(ReplicaSnapshot, good)
    assert restored is True
    assert features.build_features(*_one_decision()).shape == (2, len(good))


def _one_decision():
    from routewise_vllm.router.policy.types import ClusterView, ReplicaSnapshot, RequestInfo

    return ClusterView((ReplicaSnapshot("a", True, 1, 10), ReplicaSnapshot("b", False, 3, 30))), RequestInfo("q", 100)


def test_the_python_rows_are_generated_from_the_table():
    """The generated builder reads what the table names: a column's source changed is a column's values changed."""
    view, request = _one_decision()
    swapped = tuple(c._replace(source=value("outstanding_prompt_tokens")) if c.name == "outstanding" else c
                    for c in COLUMNS)
    rows = feature_rows._compile_rows(swapped)(view.replicas, request)
    col = features.FEATURE_NAMES.index("outstanding")
    assert [r[col] for r in rows] == [10, 30]
    assert [r[col] for r in feature_rows._raw_rows(view.replicas, request)] == [1, 3]
    raw = np.array(feature_rows._raw_rows(view.replicas, request), float)
    assert np.array_equal(features.raw_features(view, request), raw)


def test_the_cross_replica_inputs_are_checked_at_import_naming_the_input():
    check_cross()
    bad = [
        (Derived("x", Term("cube", (feature("outstanding"),))), "operation 'cube'"),
        (Derived("x", unlogged("outstanding_tokens")), "no feature column 'outstanding_tokens'"),
        (Derived("x", unlogged("kv_cache_usage")), "'kv_cache_usage' is not log1p"),
        (Derived("token_load", feature("outstanding")), "token_load: listed twice"),
        (Derived("outstanding", feature("outstanding")), "outstanding: listed twice"),
    ]
    for derived, message in bad:
        with pytest.raises(ValueError, match=message):
            check_cross(DERIVED_INPUTS + (derived,))
    with pytest.raises(ValueError, match="'waiting' is not a derived input"):
        check_cross(excess=EXCESS_INPUTS + (Excess("waiting_excess", of="waiting", offset=1.0),))


def _rows_of_decisions(rng: np.random.Generator, width: int) -> np.ndarray:
    rows = rng.uniform(0.0, 1.2, (width, features.N_FEATURES)).astype(np.float32)
    rows[:, features.FEATURE_NAMES.index("healthy")] = rng.random(width) < 0.7
    rows[:, features.FEATURE_NAMES.index("prefix_match_frac")] = rng.uniform(0, 1, width)
    return rows


def test_the_extension_computes_the_cross_replica_inputs_it_is_given():
    """The C model inputs follow the programs bound (bind_inputs), not a copy of the table of their own: one derived
    input bound with another term changes that input's columns, and only those, to what numpy makes of that term."""
    require_compiled_views()
    from routewise_vllm.router.policy import fastnet

    names = features.MODEL_INPUT_NAMES
    token_load = [names.index(n) for n in ("token_load", "token_load_above_min", "is_min_token_load",
                                            "is_max_token_load", "token_load_excess")]
    others = [j for j in range(len(names)) if j not in token_load]
    prompt_only = (Derived("token_load", unlogged("outstanding_prompt_tokens")),) + DERIVED_INPUTS[1:]
    rng = np.random.default_rng(4)
    rows = _rows_of_decisions(rng, 9)
    decode = features.FEATURE_NAMES.index("outstanding_decode_tokens")
    try:
        feature_binding.compiled.bind_inputs(*compiled_inputs(prompt_only))
        got = fastnet.inputs(rows)
    finally:
        feature_binding.compiled.bind_inputs(*compiled_inputs())
    want = model_inputs(rows, rows[:, features.FEATURE_NAMES.index("healthy")])
    np.testing.assert_allclose(got[:, others], want[:, others], rtol=2e-6, atol=2e-6)
    assert not np.allclose(got[:, token_load], want[:, token_load], rtol=1e-3)
    no_decode = rows.copy()
    no_decode[:, decode] = 0.0
    alike = model_inputs(no_decode, no_decode[:, features.FEATURE_NAMES.index("healthy")])
    np.testing.assert_allclose(got[:, token_load], alike[:, token_load], rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(fastnet.inputs(rows), want, rtol=2e-6, atol=2e-6)  # the table's own programs back


def test_the_extension_refuses_cross_replica_inputs_it_cannot_follow():
    """What bind_inputs checks itself (it indexes rows and its operand stack by them): operations, columns, stack."""
    compiled = require_compiled_views()
    width, n_rep, mask, programs, excess = good = compiled_inputs()
    try:
        for bad, message in [
            ((width, n_rep, mask, programs + ((("cube", 0, 0.0),),), excess), "operation cube is not one"),
            ((width, n_rep, mask, programs + ((("feature", width, 0.0),),), excess), f"reads column {width} of rows"),
            ((width, n_rep, mask, programs + ((("add", -1, 0.0),),), excess), "add without its operands"),
            ((width, n_rep, mask, programs + ((("const", -1, 1.0), ("const", -1, 2.0)),), excess), "leaves 2 values"),
            ((width, n_rep, mask, programs, excess + ((len(programs), 1.0),)), "excess input 1 of derived input 3"),
            ((width, n_rep, width, programs, excess), "mask column"),
            ((width, n_rep, mask, programs + ((),), excess), "non-empty tuple"),
        ]:
            with pytest.raises((ValueError, TypeError), match=message):
                compiled.bind_inputs(*bad)
    finally:  # the good table back whatever happened, without hiding what did
        compiled.bind_inputs(*good)
    from routewise_vllm.router.policy import fastnet

    rows = _rows_of_decisions(np.random.default_rng(0), 5)
    np.testing.assert_allclose(fastnet.inputs(rows), model_inputs(rows, rows[:, features.FEATURE_NAMES.index("healthy")]),
                               rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="rows of 24 features"):
        compiled.inputs(rows[:, :24].copy(), 5, np.empty((5, features.N_MODEL_INPUTS), np.float32))
