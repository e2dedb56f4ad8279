"""One column table drives every feature row: router/policy/features.py's REPLICA_COLUMNS / REQUEST_COLUMNS, which the
Python builder follows (generated from it) and the C builder receives when it binds (_fastnet.bind_rows).

The main test adds features to the table in a copy of the package (one from a snapshot field no column read yet,
and one from a new snapshot field with the tracker slot that fills it), builds the extension there from the same,
untouched C sources with the same build command, and shows the C and Python rows agree.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from routewise_vllm.router.policy import features
from routewise_vllm.router.policy.features import COLUMNS, REPLICA_COLUMNS, Column, Source, check_table, compiled_columns, value
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
    ("router/policy/features.py",  # three rows of the table
     "\n)\nREQUEST_COLUMNS",
     '\n    Column("tpot_floor_ms", value("tpot_floor_s", times=1000.0), "log1p", 5.0),'
     '\n    Column("backlog_s", capped("backlog_s", 60.0), "log1p", 3.0),'
     '\n    Column("backlog_missing", missing("backlog_s", "tpot_floor_s"), "lin", 1.0),'
     "\n)\nREQUEST_COLUMNS"),
]

CHECK = r"""
import json, sys
import numpy as np
from routewise_vllm import router
from routewise_vllm.router.policy import features, tracking
from routewise_vllm.router.policy.tracking import ClusterTracker
from routewise_vllm.router.policy.types import RequestInfo

assert router.__file__.startswith(sys.argv[1]), router.__file__  # the copy, not the checkout
assert features._compiled is not None and tracking._compiled is not None
rng = np.random.default_rng(0)
cluster = ClusterTracker([f"r{i}" for i in range(12)], prefix_block_tokens=16)
compiled = features._compiled
same, views, seen_backlog, seen_floor, wrong = True, 0, set(), False, 0
new = [features.FEATURE_NAMES.index(n) for n in ("tpot_floor_ms", "backlog_s", "backlog_missing")]


def reference(r):  # the three new columns, written out by hand
    floor = 0.0 if r.tpot_floor_s is None else r.tpot_floor_s * 1000.0
    backlog = 60.0 if r.backlog_s is None or not np.isfinite(r.backlog_s) else min(r.backlog_s, 60.0)
    backlog = 0.0 if r.backlog_s is None else backlog
    gone = r.backlog_s is None or r.tpot_floor_s is None
    return np.array([np.log1p(max(floor, 0.0)) / 5.0, np.log1p(max(backlog, 0.0)) / 3.0, float(gone)], np.float32)


for step in range(300):
    req = RequestInfo(f"q{step}", int(rng.integers(1, 4000)), None if step % 3 else 64,
                      tuple(int(x) for x in rng.integers(0, 8, int(rng.integers(0, 5)))))
    view = cluster.view(step * 0.1, req)  # built in C, the new field included
    got = features.build_features(view, req)
    features._compiled = None
    want = features.build_features(view, req)
    features._compiled = compiled
    same &= got.tobytes() == want.tobytes()
    wrong += sum(not np.array_equal(row[new], reference(r)) for row, r in zip(got, view.replicas))
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
print(json.dumps({"same": bool(same), "wrong": int(wrong), "views": views, "names": features.FEATURE_NAMES,
                  "seen_backlog": sorted(seen_backlog), "seen_floor": bool(seen_floor)}))
"""


def _edit(root: Path, rel: str, text: str, replacement: str) -> None:
    path = root / rel
    source = path.read_text()
    assert source.count(text) == 1, f"{rel}: the test's anchor {text!r} is not there once"
    path.write_text(source.replace(text, replacement))


def test_a_new_feature_is_built_alike_in_c_and_python_without_touching_c(tmp_path):
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
    rows = features._compile_rows(swapped)(view.replicas, request)
    col = features.FEATURE_NAMES.index("outstanding")
    assert [r[col] for r in rows] == [10, 30]
    assert [r[col] for r in features._raw_rows(view.replicas, request)] == [1, 3]
    raw = np.array(features._raw_rows(view.replicas, request), float)
    assert np.array_equal(features.raw_features(view, request), raw)
