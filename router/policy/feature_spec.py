"""The feature contract's fingerprint: FEATURE_SPEC_HASH, written into every exported model and checked when a
model loads (router/policy/onnx_policy.py refuses a model trained against another contract).

The hash covers the version, each per-replica and per-request column's name, transform and scale, the stats-age
cap, the cross-replica inputs' names and the expected-wait weight. It does not cover the cross-replica inputs'
formulas (router/policy/feature_table.py DERIVED_INPUTS): changing one of them without bumping FEATURE_VERSION goes
unnoticed here, so bump it with any change to the table.
"""

from __future__ import annotations

import hashlib
import json

from routewise_vllm.router.policy.feature_table import (
    CROSS_NAMES,
    EXPECTED_WAIT_DECODE_WEIGHT,
    FEATURE_NAMES,
    FEATURE_VERSION,
    MODEL_INPUT_NAMES,
    REPLICA_FEATURES,
    REQUEST_FEATURES,
    STATS_AGE_CAP_S,
)


def _spec_document() -> dict:
    return {
        "version": FEATURE_VERSION,
        "replica": [list(f) for f in REPLICA_FEATURES],
        "request": [list(f) for f in REQUEST_FEATURES],
        "stats_age_cap_s": STATS_AGE_CAP_S,
        "cross": list(CROSS_NAMES),
        "expected_wait_decode_weight": EXPECTED_WAIT_DECODE_WEIGHT,
    }


FEATURE_SPEC_HASH: str = hashlib.sha256(json.dumps(_spec_document(), sort_keys=True).encode()).hexdigest()[:16]


def spec_info() -> dict:
    """The spec as stored in model metadata."""
    return {"feature_version": FEATURE_VERSION, "feature_spec_hash": FEATURE_SPEC_HASH, "feature_names": list(FEATURE_NAMES),
            "model_input_names": list(MODEL_INPUT_NAMES)}
