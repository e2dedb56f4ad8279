"""The feature table bound into the C extension as data (router.policy._fastnet, optional).

When this module loads it hands the extension both tables of router/policy/feature_table.py: the per-replica
columns (`bind_rows`: `_fastnet.rows` builds the build_features rows by them) and the cross-replica inputs
(`bind_inputs`: each derived input's `Term` as a postfix program over column indices, and the excess inputs;
`_fastnet.inputs`, `logits`, `best` and `best_view` compute model_inputs by them). The C sources know no feature
by name or position; an extension that cannot follow the tables (built from other sources) stops the import here.
"""

from __future__ import annotations

from routewise_vllm.router.policy.feature_table import (
    COLUMNS,
    DERIVED_INPUTS,
    EXCESS_INPUTS,
    MASK_COLUMN,
    REPLICA_COLUMNS,
    Column,
    Derived,
    Excess,
    postfix,
)
from routewise_vllm.router.policy.types import ClusterView, ReplicaSnapshot, RequestInfo

try:
    from routewise_vllm.router.policy import _fastnet as compiled
except ImportError:  # built without a C compiler: the Python rows (feature_rows.py) and onnxruntime serve
    compiled = None


def compiled_columns(columns: tuple[Column, ...] = COLUMNS) -> tuple[tuple, ...]:
    """The table as `_fastnet.bind_rows` takes it: (op, names, refs as column indices, x, log, scale) per column."""
    index = {c.name: j for j, c in enumerate(columns)}
    return tuple((c.source.op, c.source.names, tuple(index[r] for r in c.source.refs), float(c.source.x),
                  c.transform == "log1p", float(c.scale)) for c in columns)


def compiled_inputs(derived: tuple[Derived, ...] = DERIVED_INPUTS, excess: tuple[Excess, ...] = EXCESS_INPUTS,
                    columns: tuple[Column, ...] = COLUMNS, n_replica: int = len(REPLICA_COLUMNS)) -> tuple:
    """The cross-replica inputs as `_fastnet.bind_inputs` takes them: (row width, replica columns, mask column,
    one program per derived input: (op, column index, x) in postfix order, x the column's scale for `unlogged`;
    one (derived input index, offset) per excess input)."""
    index = {c.name: j for j, c in enumerate(columns)}
    scale = {c.name: float(c.scale) for c in columns}

    def code(op: str, column: str, x: float) -> tuple[str, int, float]:
        return (op, index[column] if column else -1, scale[column] if op == "unlogged" else float(x))

    programs = tuple(tuple(code(*step) for step in postfix(d.term)) for d in derived)
    position = {d.name: i for i, d in enumerate(derived)}
    return (len(columns), n_replica, index[MASK_COLUMN], programs,
            tuple((position[e.of], float(e.offset)) for e in excess))


if compiled is not None:  # the same tables, passed to C; an extension that cannot follow them stops the import here
    try:
        compiled.bind_rows(ReplicaSnapshot, compiled_columns())
        compiled.bind_inputs(*compiled_inputs())
    except (AttributeError, TypeError, ValueError) as exc:
        raise ImportError(f"router.policy._fastnet cannot build the feature rows and model inputs from the feature table "
                          f"({exc}): it was built from other sources than router/policy/fastnet_c; rebuild it "
                          "(pip install -e .)") from exc


def compiled_row_args(view: ClusterView, request: RequestInfo) -> tuple | None:
    """The compiled rows' arguments for one decision (`_fastnet.rows(*args, out)` writes build_features' bytes), or
    None where build_features runs in numpy. The learned policy's fast path passes them on with the network's."""
    if compiled is None:
        return None
    reps = view.replicas
    return (reps if type(reps) is tuple else tuple(reps), request)
