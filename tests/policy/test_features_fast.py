"""The vectorised build_features gives the same bytes as the per-replica implementation it replaced.

`reference_raw_features` / `reference_build_features` below are a frozen copy of that implementation
(router/policy/features.py before the vectorisation); compared on many random views with missing
stats, infinite / NaN / negative ages, NaN scrape values, unhealthy replicas, empty views and padding.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from routewise_vllm.router.policy import feature_binding, feature_rows
from routewise_vllm.router.policy.feature_rows import _LOG_COLS, _SCALES
from routewise_vllm.router.policy.features import (
    FEATURE_NAMES,
    N_FEATURES,
    STATS_AGE_CAP_S,
    action_mask,
    build_features,
    raw_features,
)
from routewise_vllm.router.policy.tracking import ClusterTracker
from routewise_vllm.router.policy.types import ClusterView, ReplicaSnapshot, RequestInfo
from tests.ci import require_compiled_views

# ---- frozen reference (do not edit) ------------------------------------------------------------


def reference_raw_features(view: ClusterView, request: RequestInfo) -> np.ndarray:
    """Untransformed values, float64, shape (n_replicas, N_FEATURES)."""
    reps = view.replicas
    healthy_out = [r.outstanding for r in reps if r.healthy]
    min_out = min(healthy_out) if healthy_out else 0
    n_healthy = len(healthy_out)
    n_blocks = len(request.prefix_blocks)
    max_tok = request.max_tokens
    req = (
        request.prompt_tokens_est,
        max_tok if max_tok is not None else 0,
        1.0 if max_tok is None else 0.0,
        n_blocks,
        n_healthy,
    )
    rows = []
    for r in reps:
        missing = not r.has_stats
        frac = r.prefix_match_blocks / n_blocks if n_blocks else 0.0
        lat_missing = r.ttft_ema_s is None or r.tpot_ema_s is None
        rows.append(
            (
                1.0,
                1.0 if r.healthy else 0.0,
                r.outstanding,
                r.outstanding - min_out if r.healthy else 0,
                r.outstanding_prompt_tokens,
                r.outstanding_decode_tokens,
                0 if r.waiting is None else r.waiting,
                0 if r.running is None else r.running,
                0.0 if r.kv_cache_usage is None else r.kv_cache_usage,
                1.0 if missing else 0.0,
                min(r.stats_age_s, STATS_AGE_CAP_S) if math.isfinite(r.stats_age_s) else STATS_AGE_CAP_S,
                r.dispatched_since_scrape,
                0 if r.kv_capacity_tokens is None else r.kv_capacity_tokens,
                frac,
                frac * request.prompt_tokens_est,
                0.0 if r.ttft_ema_s is None else r.ttft_ema_s * 1000.0,
                0.0 if r.tpot_ema_s is None else r.tpot_ema_s * 1000.0,
                1.0 if lat_missing else 0.0,
                r.awaiting_first_token,
                r.awaiting_prompt_tokens,
            )
            + req
        )
    return np.array(rows, dtype=np.float64).reshape(len(reps), N_FEATURES)


def reference_build_features(view: ClusterView, request: RequestInfo, pad_to: int | None = None) -> np.ndarray:
    """Model input, float32, shape (n, N_FEATURES) or (pad_to, N_FEATURES) with zero padding."""
    raw = reference_raw_features(view, request)
    raw = np.maximum(raw, 0.0)
    raw[:, _LOG_COLS] = np.log1p(raw[:, _LOG_COLS])
    out = (raw / _SCALES).astype(np.float32)
    if pad_to is not None:
        if pad_to < out.shape[0]:
            raise ValueError(f"pad_to={pad_to} is smaller than the replica count {out.shape[0]}")
        padded = np.zeros((pad_to, N_FEATURES), dtype=np.float32)
        padded[: out.shape[0]] = out
        return padded
    return out


def reference_action_mask(view: ClusterView, pad_to: int | None = None) -> np.ndarray:
    n = len(view.replicas) if pad_to is None else pad_to
    mask = np.zeros(n, dtype=np.int8)
    for i, r in enumerate(view.replicas):
        mask[i] = 1 if r.healthy else 0
    return mask


# ---- random views ------------------------------------------------------------------------------


def _maybe(rng: np.random.Generator, p_none: float, value):
    return None if rng.random() < p_none else value


def _age(rng: np.random.Generator) -> float:
    kind = rng.integers(0, 8)
    if kind == 0:
        return math.inf
    if kind == 1:
        return float(rng.choice([math.nan, -math.inf, -0.0, 0.0, -1.5, STATS_AGE_CAP_S, 1e9]))
    if kind == 2:
        return int(rng.integers(0, 5000))  # an int age, as a hand-built view may carry
    return float(rng.exponential(5.0))


def random_snapshot(rng: np.random.Generator, i: int, p_none: float) -> ReplicaSnapshot:
    return ReplicaSnapshot(
        replica_id=f"r{i}",
        healthy=bool(rng.random() < 0.8),
        outstanding=int(rng.integers(0, 200)),
        outstanding_prompt_tokens=int(rng.integers(0, 10**6)),
        outstanding_decode_tokens=int(rng.integers(0, 10**5)),
        waiting=_maybe(rng, p_none, int(rng.integers(0, 64))),
        running=_maybe(rng, p_none, int(rng.integers(0, 256))),
        kv_cache_usage=_maybe(rng, p_none, float(rng.choice([rng.random(), math.nan, 1.5, -0.0]))),
        kv_capacity_tokens=_maybe(rng, p_none, int(rng.integers(0, 10**7))),
        stats_age_s=_age(rng),
        dispatched_since_scrape=int(rng.integers(0, 50)),
        prefix_match_blocks=int(rng.integers(0, 20)),
        ttft_ema_s=_maybe(rng, p_none, float(rng.choice([rng.exponential(0.2), math.nan, 0.0]))),
        tpot_ema_s=_maybe(rng, p_none, float(rng.exponential(0.03))),
        awaiting_first_token=int(rng.integers(0, 50)),
        awaiting_prompt_tokens=int(rng.integers(0, 10**6)),
    )


def random_request(rng: np.random.Generator) -> RequestInfo:
    n_blocks = int(rng.choice([0, 0, 1, 5, 16]))
    return RequestInfo(
        request_id="q",
        prompt_tokens_est=int(rng.choice([0, int(rng.integers(1, 100_000))])),
        max_tokens=None if rng.random() < 0.3 else int(rng.integers(0, 4096)),
        prefix_blocks=tuple(int(x) for x in rng.integers(0, 2**62, n_blocks)),
    )


def random_view(rng: np.random.Generator) -> ClusterView:
    n = int(rng.choice([0, 1, 2, 3, 8, 16, 64, 128]))
    p_none = float(rng.choice([0.0, 0.0, 0.1, 0.5, 1.0]))
    reps = [random_snapshot(rng, i, p_none) for i in range(n)]
    if n and rng.random() < 0.1:
        reps = [ReplicaSnapshot(r.replica_id, False, r.outstanding, r.outstanding_prompt_tokens) for r in reps]
    return ClusterView(tuple(reps))


# both builders of the rows, each following the column table: the compiled one and the Python one (which serves
# where no C compiler was available)
PATHS = [pytest.param(True, id="compiled"), pytest.param(False, id="python")]


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("seed", range(12))
def test_build_features_is_bit_identical_to_the_per_replica_reference(seed, compiled, monkeypatch):
    if compiled:
        require_compiled_views()
    else:
        monkeypatch.setattr(feature_rows, "_compiled", None)
    rng = np.random.default_rng(seed)
    for _ in range(40):
        view, request = random_view(rng), random_request(rng)
        n = len(view)
        assert raw_features(view, request).tobytes() == reference_raw_features(view, request).tobytes()
        got, want = build_features(view, request), reference_build_features(view, request)
        assert got.dtype == want.dtype == np.float32 and got.shape == want.shape == (n, N_FEATURES)
        assert got.tobytes() == want.tobytes()
        pad = n + int(rng.integers(0, 5))
        assert build_features(view, request, pad_to=pad).tobytes() == reference_build_features(view, request, pad).tobytes()
        assert action_mask(view).tobytes() == reference_action_mask(view).tobytes()
        assert action_mask(view, pad).tobytes() == reference_action_mask(view, pad).tobytes()
        # OnnxPolicy feeds the `healthy` column as the model's mask
        assert got[:, FEATURE_NAMES.index("healthy")].tobytes() == action_mask(view).astype(np.float32).tobytes()


def test_views_from_a_tracker_are_bit_identical_including_cold_start():
    rng = np.random.default_rng(7)
    cluster = ClusterTracker([f"r{i}" for i in range(64)])
    for step in range(300):
        req = RequestInfo(f"q{step}", int(rng.integers(1, 4000)), None if step % 3 else 64,
                          tuple(int(x) for x in rng.integers(0, 8, int(rng.integers(0, 6)))))
        view = cluster.view(step * 0.1, req)
        assert build_features(view, req).tobytes() == reference_build_features(view, req).tobytes()
        i = int(rng.integers(0, 64))
        cluster.dispatch(i, req)
        if step % 7 == 0:
            cluster.trackers[i].on_scrape(step * 0.1, int(rng.integers(0, 5)), None if step % 2 else 3, 0.4, 10_000)
        if step % 5 == 0:
            cluster.trackers[i].on_first_token(req.request_id, 0.1)
        if step % 11 == 0:
            cluster.trackers[int(rng.integers(0, 64))].healthy = bool(step % 2)


def test_the_reference_exercises_what_it_should():
    """The random views do reach the edge cases (else the equality test above proves little)."""
    rng = np.random.default_rng(0)
    seen = {"missing": False, "nan": False, "capped_age": False, "unhealthy": False, "empty": False}
    for _ in range(400):
        view, request = random_view(rng), random_request(rng)
        f = reference_build_features(view, request)
        seen["empty"] |= len(view) == 0
        if len(view):
            seen["missing"] |= bool((f[:, 9] == 1.0).any())
            seen["nan"] |= bool(np.isnan(f).any())
            seen["capped_age"] |= bool((f[:, 10] == np.float32(math.log1p(STATS_AGE_CAP_S) / 3.0)).any())
            seen["unhealthy"] |= bool((f[:, 1] == 0.0).any())
    assert all(seen.values()), seen


class _DuckSnapshot:
    """Not a ReplicaSnapshot: the compiled path reads it with getattr instead of by slot offset."""

    def __init__(self, snap: ReplicaSnapshot) -> None:
        for name in ReplicaSnapshot.__slots__:
            setattr(self, name, getattr(snap, name))


def test_compiled_rows_read_by_slot_and_by_getattr_give_the_same_bytes():
    require_compiled_views()
    assert feature_binding.compiled.bind_rows(ReplicaSnapshot, feature_binding.compiled_columns()) is True
    rng = np.random.default_rng(3)
    for _ in range(60):
        view, request = random_view(rng), random_request(rng)
        duck = ClusterView(tuple(_DuckSnapshot(r) for r in view.replicas))  # type: ignore[arg-type]
        want = reference_build_features(view, request).tobytes()
        assert build_features(view, request).tobytes() == want
        assert build_features(duck, request).tobytes() == want
