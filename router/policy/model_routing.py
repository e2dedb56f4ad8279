"""Which replicas may take a request for a model: the one rule the live router and the simulator share.

A replica is a candidate for a request when the model list it serves holds the request's `model` (a base
model or a LoRA adapter: vLLM lists both in /v1/models). Policies then decide on the view restricted to those
replicas (`late_binding.restrict`: the others are not candidates and never enter the fleet statistics a learned
policy computes), so every policy, heuristic or learned, decides among the replicas of the request's model.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The metric / decision-log label of a model the fleet does not serve, or of one past the label bound.
OTHER_MODEL = "other"


def members(model: str | None, served: Sequence[frozenset[str] | None]) -> tuple[int, ...] | None:
    """Indices of the replicas that serve `model`, in view order; None when every replica may take it (no
    model asked, or each replica serves it: `served[i]` None means replica i serves any model)."""
    if model is None:
        return None
    out = tuple(i for i, s in enumerate(served) if s is None or model in s)
    return None if len(out) == len(served) else out


def model_label(model: str | None, known: frozenset[str]) -> str:
    """The model when the fleet serves it, else OTHER_MODEL (bounded by the fleet's list only: see ModelLabels)."""
    return model if model is not None and model in known else OTHER_MODEL


class ModelLabels:
    """Model label values bounded by a number, not by the fleet's list (which lists every LoRA adapter, and the
    client picks among them): the first `limit` distinct served models seen keep their name, any other model is
    OTHER_MODEL. A name once given keeps its label while the fleet serves it."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"a model label bound must be >= 0, got {limit}")
        self.limit = limit
        self._named: set[str] = set()

    def __call__(self, model: str | None, known: frozenset[str]) -> str:
        if model is None or model not in known:
            return OTHER_MODEL
        if model in self._named:
            return model
        if len(self._named) < self.limit:
            self._named.add(model)
            return model
        return OTHER_MODEL

    @property
    def named(self) -> frozenset[str]:
        """The models that have a label of their own."""
        return frozenset(self._named)
