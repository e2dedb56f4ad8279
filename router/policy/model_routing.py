"""Which replicas may take a request for a model: the one rule the live router and the simulator share.

A replica is a candidate for a request when the model list it serves holds the request's `model` (a base
model or a LoRA adapter: vLLM lists both in /v1/models). Policies then decide on the view restricted to those
replicas (`late_binding.restrict`: the others are not candidates and never enter the fleet statistics a learned
policy computes), so every policy, heuristic or learned, decides among the replicas of the request's model.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The metric / decision-log label of a model the fleet does not serve (labels stay bounded by the fleet).
OTHER_MODEL = "other"


def members(model: str | None, served: Sequence[frozenset[str] | None]) -> tuple[int, ...] | None:
    """Indices of the replicas that serve `model`, in view order; None when every replica may take it (no
    model asked, or each replica serves it: `served[i]` None means replica i serves any model)."""
    if model is None:
        return None
    out = tuple(i for i, s in enumerate(served) if s is None or model in s)
    return None if len(out) == len(served) else out


def model_label(model: str | None, known: frozenset[str]) -> str:
    """A bounded label: the model when the fleet serves it, else OTHER_MODEL."""
    return model if model is not None and model in known else OTHER_MODEL
