"""What crosses the boundary between the learner and its rollout workers (trainer/rollout.py): typed jobs and results.

Everything here is pickled over a pipe, so it holds plain data only (numpy arrays, an InstanceSpec, floats).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from routewise_vllm.trainer.instances import InstanceSpec


@dataclass(frozen=True)
class HeuristicJob:
    """One episode routed by the baseline `policy`."""

    spec: InstanceSpec
    policy: str


@dataclass(frozen=True)
class RolloutJob:
    """One episode of the network; with `paired` (a baseline name), rewards become (policy - that baseline)."""

    spec: InstanceSpec
    paired: str | None = None


@dataclass
class HeuristicRun:
    """A baseline's episode as a worker sends it back: its summary, and its decisions when recorded."""

    spec: InstanceSpec
    policy: str
    summary: dict[str, float]
    features: np.ndarray | None = None  # [T, R, F], recorded runs only
    masks: np.ndarray | None = None  # [T, R]
    actions: np.ndarray | None = None  # [T]


@dataclass
class Episode:
    """One whole episode of the network, as a rollout worker sends it to the learner (one row per decision)."""

    features: np.ndarray  # [T, R, F] float32
    masks: np.ndarray  # [T, R] float32
    actions: np.ndarray  # [T] int64
    logprobs: np.ndarray  # [T] float32
    values: np.ndarray  # [T] float32
    rewards: np.ndarray  # [T] float64; paired (policy - heuristic) once a worker has paired them
    times: np.ndarray  # [T] float64, simulated decision times
    fallback_free_share: float  # share of decisions the router's guards let through (nan: not judged)
    terminal: bool = True  # the episode really ended (no bootstrap from `last_value`)
    last_value: float = 0.0
    spec: InstanceSpec | None = None
    summary: dict[str, float] = field(default_factory=dict)  # simulator.metrics.summarize of the run
    raw_return: float = float("nan")  # sum of the unpaired rewards
    paired_return: float | None = None  # the paired heuristic's return on the same arrivals
    records: list | None = None  # the simulator's request records; summarised and dropped in the worker


@dataclass(frozen=True)
class ExploreJob:
    """One exploration episode: route with `behaviour` (a baseline name, or None for the network
    in `state_dict`), picking a uniformly random healthy replica with probability `epsilon`."""

    spec: InstanceSpec
    behaviour: str | None
    epsilon: float


@dataclass
class LatencySamples:
    """One exploration episode's decisions and the decision-to-first-token time of each (what a worker sends back)."""

    spec: InstanceSpec
    features: np.ndarray  # [T, R, F]
    masks: np.ndarray  # [T, R]
    actions: np.ndarray  # [T] int64
    ttft_s: np.ndarray  # [T] float64
