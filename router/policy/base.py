"""The one Policy interface every router (baseline, learned, wrapper) implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from routewise_vllm.router.policy.types import ClusterView, NoHealthyReplica, Outcome, RequestInfo


class PolicyUnavailable(RuntimeError):
    """A policy that cannot decide at all (missing/corrupt model, spec mismatch). `reason` is a
    short bounded label for metrics; the message says what was wrong."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Decision:
    index: int
    primary_index: int | None  # what the primary said (None if it said nothing usable)
    fallback_reason: str | None  # None when the primary's pick was used
    elapsed_s: float | None = None  # primary decision time when a clock was given
    error: str | None = None  # the exception text, for logs and the admin API


class Policy(ABC):
    """`choose` picks a replica. A scoring policy (learned) also overrides `scores`, and `best` when it has a faster
    way to best_of(scores): FallbackPolicy then checks the scores (finite, confident) before it trusts the pick.
    `decide` is the pipeline's policy stage (router.policy.pipeline): FallbackPolicy adds the guards."""

    name: ClassVar[str]

    def __init__(self, seed: int | None = None) -> None:
        self.rng = np.random.default_rng(seed)

    @abstractmethod
    def choose(self, view: ClusterView, request: RequestInfo) -> int:
        """Index into `view.replicas` of a healthy replica."""

    def scores(self, view: ClusterView, request: RequestInfo) -> np.ndarray | None:
        """One logit per replica of `view` (the largest healthy one is the pick), or None: this policy does not score."""
        return None

    def best(self, view: ClusterView, request: RequestInfo) -> tuple[int, bool] | None:
        """best_of(scores(view, request), healthy) in fewer steps, or None: no faster way than the scores."""
        return None

    def binds_late(self, view: ClusterView, request: RequestInfo) -> bool:
        """Whether late binding's rule applies to this request (the pipeline's room stage asks first); False: the
        policy picks over every candidate at once (the gate while a heuristic routes a uniform pool where the cache
        decides, router.policy.gated)."""
        return True

    def decide(self, view: ClusterView, request: RequestInfo, context: ClusterView | None = None) -> Decision:
        """The pipeline's policy stage: `choose` on `view` (a heuristic decides on the candidates; `context`, the
        whole fleet when late binding restricted `view`, is for the scoring policies behind FallbackPolicy)."""
        i = self.choose(view, request)
        return Decision(i, i, None)

    def on_complete(self, replica_id: str, request: RequestInfo, outcome: Outcome) -> None:
        return None

    def reset(self, seed: int | None = None) -> None:
        self.rng = np.random.default_rng(seed)

    def describe(self) -> dict:
        return {"name": self.name}


def healthy_or_raise(view: ClusterView) -> list[int]:
    idx = view.healthy_indices()
    if not idx:
        raise NoHealthyReplica("no healthy replica in the view")
    return idx


def best_of(scores: np.ndarray, healthy: list[bool]) -> tuple[int, bool]:
    """(index of the largest score among healthy replicas, the first on a tie, -1 if none is healthy; whether
    every healthy replica's score is finite). How FallbackPolicy reads a primary's scores; a policy with a
    faster way to the same answer offers it as `best(view, request)`."""
    if all(healthy):  # the usual decision: no masking
        return int(scores.argmax()), bool(np.isfinite(scores).all())
    mask = np.array(healthy, dtype=bool)
    if not mask.any():
        return -1, True
    return int(np.where(mask, scores, -np.inf).argmax()), bool(np.isfinite(scores[mask]).all())


def argmin_random_ties(values: list[float], candidates: list[int], rng: np.random.Generator) -> int:
    """The candidate with the smallest value; ties broken uniformly at random."""
    best = min(values)
    tied = [c for c, v in zip(candidates, values) if v == best]
    return tied[0] if len(tied) == 1 else tied[int(rng.integers(len(tied)))]
