"""The feature contract, one import point: the only code that turns (ClusterView, RequestInfo) into model input.

It is split by job, each module under router/policy/:

- feature_table.py: the table, every input as data (per-replica columns, cross-replica inputs) and its checks;
- feature_rows.py: the build_features rows, in Python, generated from the table (and the compiled rows' entry);
- cross_inputs.py: `model_inputs`, the rows followed by the cross-replica inputs, in numpy;
- feature_binding.py: both tables handed to the C extension as data when it loads;
- feature_spec.py: the spec hash every model carries and the router checks when it loads one.

The names below stay importable from here.
"""

from __future__ import annotations

from routewise_vllm.router.policy.cross_inputs import model_inputs
from routewise_vllm.router.policy.feature_binding import compiled_columns, compiled_inputs, compiled_row_args
from routewise_vllm.router.policy.feature_rows import action_mask, build_features, raw_features
from routewise_vllm.router.policy.feature_spec import FEATURE_SPEC_HASH, spec_info
from routewise_vllm.router.policy.feature_table import (
    COLUMNS,
    CROSS_NAMES,
    DERIVED_INPUTS,
    DERIVED_NAMES,
    EXCESS_INPUTS,
    EXPECTED_WAIT_DECODE_WEIGHT,
    FEATURE_NAMES,
    FEATURE_VERSION,
    MODEL_INPUT_NAMES,
    N_FEATURES,
    N_MODEL_INPUTS,
    PER_REQUEST_OPS,
    REPLICA_COLUMNS,
    REPLICA_FEATURES,
    REQUEST_COLUMNS,
    REQUEST_FEATURES,
    STATS_AGE_CAP_S,
    Column,
    Derived,
    Excess,
    Source,
    Term,
    above_min,
    capped,
    check_cross,
    check_table,
    const,
    count,
    feature,
    flag,
    missing,
    product,
    relative,
    request,
    request_len,
    request_missing,
    share,
    unlogged,
    value,
)

__all__ = [
    "COLUMNS", "CROSS_NAMES", "DERIVED_INPUTS", "DERIVED_NAMES", "EXCESS_INPUTS", "EXPECTED_WAIT_DECODE_WEIGHT",
    "FEATURE_NAMES", "FEATURE_SPEC_HASH", "FEATURE_VERSION", "MODEL_INPUT_NAMES", "N_FEATURES", "N_MODEL_INPUTS",
    "PER_REQUEST_OPS", "REPLICA_COLUMNS", "REPLICA_FEATURES", "REQUEST_COLUMNS", "REQUEST_FEATURES", "STATS_AGE_CAP_S",
    "Column", "Derived", "Excess", "Source", "Term", "above_min", "action_mask", "build_features", "capped",
    "check_cross", "check_table", "compiled_columns", "compiled_inputs", "compiled_row_args", "const", "count",
    "feature", "flag", "missing", "model_inputs", "product", "raw_features", "relative", "request", "request_len",
    "request_missing", "share", "spec_info", "unlogged", "value",
]
