"""The compiled fast path (router/policy/fastnet.py) against its references: model_inputs (numpy) and the
model file's own onnxruntime session; and what happens when it cannot serve."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from routewise_vllm.router.policy import fastnet
from routewise_vllm.router.policy.base import best_of
from routewise_vllm.router.policy.features import FEATURE_NAMES, N_FEATURES, build_features, model_inputs
from routewise_vllm.router.policy.onnx_policy import OnnxPolicy
from routewise_vllm.router.policy.registry import DEFAULT_MODEL_PATH
from tests.ci import in_ci

# CI builds the extension: there a missing one fails these tests (and the one below), elsewhere it skips them
needs_ext = pytest.mark.skipif(not fastnet.available() and not in_ci(), reason="C extension not built")
HEALTHY = FEATURE_NAMES.index("healthy")
INDICATORS = slice(N_FEATURES + 3 * 20 + 2 * 3, -1)  # is_min / is_max columns: exact 0/1


def test_ci_builds_the_extension() -> None:
    """CI installs with a C compiler: there the fast path must exist (elsewhere it is optional)."""
    if not in_ci() and not fastnet.available():
        pytest.skip("built without the C extension (only CI must have it)")
    assert fastnet.available(), "the C extension router.policy._fastnet is not built (no C compiler at install)"


def _rows(rng: np.random.Generator, width: int, healthy_share: float) -> np.ndarray:
    rows = rng.uniform(0.0, 1.5, (width, N_FEATURES))
    rows[:, N_FEATURES - 5 :] = rows[0, N_FEATURES - 5 :]  # the request block, the same on every row
    rows[:, FEATURE_NAMES.index("prefix_match_frac")] = rng.uniform(0, 1, width)
    rows[:, FEATURE_NAMES.index("present")] = 1.0
    rows[:, HEALTHY] = (rng.random(width) < healthy_share).astype(np.float32)
    if width > 3:  # ties, where the is-min / is-max indicators are decided by the 1e-6 tolerance
        rows[1] = rows[0]
    return rows.astype(np.float32)


@needs_ext
@pytest.mark.parametrize("width", [1, 2, 7, 16, 40])
@pytest.mark.parametrize("healthy_share", [1.0, 0.6, 0.0])
def test_c_inputs_equal_model_inputs(width: int, healthy_share: float) -> None:
    rng = np.random.default_rng(width * 10 + int(healthy_share * 10))
    for _ in range(20):
        rows = _rows(rng, width, healthy_share)
        want = model_inputs(rows, rows[:, HEALTHY])
        got = fastnet.inputs(rows)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
        np.testing.assert_array_equal(got[:, INDICATORS], want[:, INDICATORS])
        np.testing.assert_array_equal(got[:, :N_FEATURES], rows)


SHIPPED_MODELS = sorted(DEFAULT_MODEL_PATH.parent.glob("*.onnx"))


def test_the_four_models_ship():
    assert {p.name for p in SHIPPED_MODELS} == {"suite-fleet.onnx", "any-fleet.onnx", "late-fleet.onnx",
                                                "cache-fleet.onnx"}


@needs_ext
@pytest.mark.parametrize("model", SHIPPED_MODELS, ids=lambda p: p.name)
def test_shipped_model_decides_on_the_fast_path_like_onnxruntime(model) -> None:
    policy = OnnxPolicy(model)
    assert policy.describe()["executor"] == "fastnet", policy.executor_note
    rng = np.random.default_rng(7)
    # widths off every block size of the C loops: rows in threes, keys and exponentials in eights
    for width in (1, 2, 3, 5, 16, 33, 64, 128, 200):
        for _ in range(10):
            rows = _rows(rng, width, 0.8)
            want = policy.onnxruntime_logits(rows)
            got = policy._fast.logits(rows)
            valid = rows[:, HEALTHY] > 0.5
            if not valid.any():
                continue
            assert np.abs(got - want)[valid].max() < 1e-4
            assert np.argmax(got) == np.argmax(want)
            assert (got[~valid] == -1e9).all()


@needs_ext
def test_best_is_best_of_the_logits() -> None:
    """FastNet.best (one C call) = base.best_of(logits, healthy): finiteness judged on healthy replicas only,
    and where finite, the first largest healthy logit (-1 when none is healthy)."""
    net = OnnxPolicy(DEFAULT_MODEL_PATH)._fast
    rng = np.random.default_rng(11)
    seen = {"masked": 0, "none_healthy": 0, "nan": 0, "tie": 0}
    for width in (1, 2, 3, 16, 64, 128):
        for healthy_share in (0.0, 0.5, 1.0):
            for k in range(6):
                rows = _rows(rng, width, healthy_share)
                if k == 5 and width > 3:  # two identical healthy rows ranking first: the first one wins
                    rows[:, HEALTHY] = 0.0
                    rows[2, HEALTHY] = rows[3, HEALTHY] = 1.0
                    rows[3] = rows[2]
                    seen["tie"] += 1
                if k == 4:  # a NaN feature makes that replica's logit NaN
                    rows[width - 1, FEATURE_NAMES.index("outstanding")] = np.nan
                logits = net.logits(rows)
                healthy = [bool(h > 0.5) for h in rows[:, HEALTHY]]
                want = best_of(logits.astype(np.float64), healthy)
                got = net.best(rows)
                assert got[1] == want[1], (width, healthy_share, k)
                if want[1]:  # a non-finite score falls back whatever the pick
                    assert got[0] == want[0], (width, healthy_share, k)
                seen["masked"] += 0 < sum(healthy) < width
                seen["none_healthy"] += not any(healthy)
                seen["nan"] += not want[1]
    assert all(seen.values()), seen


@needs_ext
def test_best_view_decides_as_best_of_build_features() -> None:
    """OnnxPolicy.best builds the rows inside the network's C call (FastNet.best_view): the same pick and the
    same finiteness as FastNet.best on build_features of the same view, on tracker views of every kind."""
    from routewise_vllm.router.policy.features import compiled_row_args
    from routewise_vllm.router.policy.tracking import ClusterTracker
    from routewise_vllm.router.policy.types import RequestInfo

    policy = OnnxPolicy(DEFAULT_MODEL_PATH)
    rng = np.random.default_rng(5)
    for width in (1, 2, 3, 7, 16, 33, 128):
        cluster = ClusterTracker([f"10.0.0.{i}:8000" for i in range(width)])
        for i, t in enumerate(cluster.trackers):
            if i % 3:  # the rest never scraped: stats missing
                t.on_scrape(0.0, int(rng.integers(0, 8)), int(rng.integers(1, 32)), float(rng.uniform(0, 1)), 262_144)
            for k in range(int(rng.integers(0, 6))):
                cluster.dispatch(i, RequestInfo(f"w{i}-{k}", int(rng.integers(50, 3000)), 256, (1, 2, int(rng.integers(3, 9)))))
            t.healthy = bool(rng.random() > 0.2 or i == 0)
        for k in range(10):
            request = RequestInfo(f"q{k}", int(rng.integers(10, 4000)), None if k % 4 == 0 else int(rng.integers(1, 512)),
                                  tuple(int(x) for x in rng.integers(0, 9, k % 5)))
            view = cluster.view(float(rng.uniform(0, 30)), request)
            assert compiled_row_args(view, request) is not None
            assert policy.best(view, request) == policy._fast.best(build_features(view, request))


@needs_ext
def test_best_view_refuses_bad_input_instead_of_crashing() -> None:
    from routewise_vllm.router.policy import _fastnet
    from routewise_vllm.router.policy.types import ReplicaSnapshot, RequestInfo

    net = OnnxPolicy(DEFAULT_MODEL_PATH)._fast
    rep, req = ReplicaSnapshot("r0", True, 1, 10), RequestInfo("q", 1000)
    spec = (net._weights, net._dims)
    assert _fastnet.best_view((rep,), req, *spec) == (0, True)
    with pytest.raises(ValueError, match="no replicas"):
        _fastnet.best_view((), req, *spec)
    with pytest.raises(AttributeError):
        _fastnet.best_view((rep,), object(), *spec)
    with pytest.raises(AttributeError):
        _fastnet.best_view((object(),), req, *spec)
    with pytest.raises(ValueError, match="features"):
        _fastnet.best_view((rep,), req, net._weights, (24, *net._dims[1:]))
    with pytest.raises(ValueError, match="weight blob"):
        _fastnet.best_view((rep,), req, net._weights[:-32], net._dims)


def _with_metadata(tmp_path, change) -> OnnxPolicy:
    """A copy of the shipped model whose `fastnet` metadata is changed by `change(value) -> value or None`."""
    import onnx

    model = onnx.load(str(DEFAULT_MODEL_PATH))
    for entry in list(model.metadata_props):
        if entry.key == fastnet.METADATA_KEY:
            new = change(entry.value)
            if new is None:
                model.metadata_props.remove(entry)
            else:
                entry.value = new
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    return OnnxPolicy(path)


def _scaled_weights(value: str, factor: float, cut: int = 0) -> str:
    doc = json.loads(value)
    w = np.frombuffer(base64.b64decode(doc["weights"]), dtype=np.float32) * np.float32(factor)
    doc["weights"] = base64.b64encode(w[: len(w) - cut].tobytes()).decode()
    return json.dumps(doc)


@needs_ext
def test_onnxruntime_serves_when_the_fast_path_cannot(tmp_path) -> None:
    """No weights, weights cut short, weights that disagree with the graph: onnxruntime decides, saying why."""
    cases = {
        "no 'fastnet' weights": lambda v: None,
        "fast path unusable": lambda v: _scaled_weights(v, 1.0, cut=3),
        "disagrees with onnxruntime": lambda v: _scaled_weights(v, 1.01),
    }
    from routewise_vllm.router.policy.tracking import ClusterTracker
    from routewise_vllm.router.policy.types import RequestInfo

    import onnxruntime

    session = onnxruntime.InferenceSession(str(DEFAULT_MODEL_PATH), providers=["CPUExecutionProvider"])

    def reference(view, request) -> np.ndarray:  # onnxruntime alone, on the unchanged model
        rows = build_features(view, request)
        mask = np.ascontiguousarray(rows[None, :, HEALTHY])
        return session.run(["logits"], {"features": model_inputs(rows[None], mask), "mask": mask})[0][0]

    rng = np.random.default_rng(0)
    cluster = ClusterTracker([f"10.0.0.{i}:8000" for i in range(5)])
    for i, t in enumerate(cluster.trackers):
        t.on_scrape(0.0, i, 2 * i + 1, 0.1 * i, 262_144)
    requests = [RequestInfo(f"q{k}", int(rng.integers(10, 4000)), int(rng.integers(1, 512)), (1, 2, k)) for k in range(8)]
    for why, change in cases.items():
        policy = _with_metadata(tmp_path, change)
        info = policy.describe()
        assert info["executor"] == "onnxruntime" and why in info["executor_note"], info
        assert policy.load_error is None
        for request in requests:  # what the policy decides with is onnxruntime's answer, not the changed weights'
            view = cluster.view(1.0, request)
            want = reference(view, request)
            np.testing.assert_allclose(policy.scores(view, request), want, rtol=1e-6, atol=1e-6)
            assert policy.best(view, request) == best_of(want.astype(np.float64), [r.healthy for r in view.replicas])


def test_fast_path_can_be_turned_off() -> None:
    policy = OnnxPolicy(DEFAULT_MODEL_PATH, fast=False)
    assert policy.describe()["executor"] == "onnxruntime"
    assert "turned off" in policy.executor_note


@needs_ext
def test_bad_buffers_raise_instead_of_crashing() -> None:
    from routewise_vllm.router.policy import _fastnet

    net = OnnxPolicy(DEFAULT_MODEL_PATH)._fast
    rows = np.zeros((4, N_FEATURES), np.float32)
    with pytest.raises(ValueError, match="rows"):
        _fastnet.logits(rows, 5, net._weights, net._dims, np.empty(5, np.float32))
    with pytest.raises(ValueError, match="weight blob"):
        _fastnet.logits(rows, 4, net._weights[:-8], net._dims, np.empty(4, np.float32))
    with pytest.raises(ValueError, match="out"):
        _fastnet.logits(rows, 4, net._weights, net._dims, np.empty(3, np.float32))
    with pytest.raises(ValueError, match="no replicas"):
        _fastnet.logits(rows[:0], 0, net._weights, net._dims, np.empty(0, np.float32))


@needs_ext
def test_weights_are_laid_out_for_aligned_vector_loads() -> None:
    """Each packed array starts on a 64-byte boundary, in pack_layout's order, with its values unchanged."""
    value = json.loads(OnnxPolicy(DEFAULT_MODEL_PATH, fast=False).metadata[fastnet.METADATA_KEY])
    flat = np.frombuffer(base64.b64decode(value["weights"]), dtype=np.float32)
    weights = fastnet.FastNet(json.dumps(value))._weights
    assert weights.ctypes.data % 64 == 0
    at = src = 0
    for _, shape in fastnet.pack_layout(value["hidden"], value["layers"]):
        n = int(np.prod(shape))
        assert (weights.ctypes.data + 4 * at) % 64 == 0
        np.testing.assert_array_equal(weights[at : at + n], flat[src : src + n])
        assert not weights[at + n : at + -(-n // 16) * 16].any()  # the padding
        at, src = at + -(-n // 16) * 16, src + n
    assert at == len(weights) and src == len(flat)


def test_layout_covers_the_blob_exactly() -> None:
    """pack_layout is the one description of the blob: FastNet refuses a blob of any other size."""
    value = json.loads(OnnxPolicy(DEFAULT_MODEL_PATH, fast=False).metadata[fastnet.METADATA_KEY])
    n = sum(int(np.prod(s)) for _, s in fastnet.pack_layout(value["hidden"], value["layers"]))
    assert len(base64.b64decode(value["weights"])) == 4 * n
    value["layers"] += 1
    with pytest.raises(ValueError, match="bytes of weights"):
        fastnet.FastNet(json.dumps(value))


@needs_ext
def test_compiled_rows_refuse_bad_input_instead_of_crashing() -> None:
    from routewise_vllm.router.policy import _fastnet
    from routewise_vllm.router.policy.types import ReplicaSnapshot, RequestInfo

    rep, req = ReplicaSnapshot("r0", True, 1, 10), RequestInfo("q", 1000)
    with pytest.raises(ValueError, match="out"):
        _fastnet.rows((rep,), req, np.empty((2, N_FEATURES), np.float32))
    with pytest.raises(AttributeError):
        _fastnet.rows((object(),), req, np.empty((1, N_FEATURES), np.float32))
    with pytest.raises(TypeError):
        _fastnet.rows((ReplicaSnapshot("r0", True, "many", 10),), req, np.empty((1, N_FEATURES), np.float32))
    with pytest.raises(TypeError):
        _fastnet.rows((rep,), RequestInfo("q", 1000, prefix_blocks=None), np.empty((1, N_FEATURES), np.float32))
