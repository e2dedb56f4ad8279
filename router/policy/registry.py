"""Policy names to policies. Unknown names raise, listing the known ones.

A policy is a baseline by name, a shipped model by name (the stem of a file in router/policy/models/:
`any-fleet`, `cache-fleet`, `late-fleet`, `suite-fleet`), `learned` (the recommended shipped model,
RECOMMENDED_MODEL), `gated` (`learned` behind the gate, router/policy/gated.py), `gated:MODEL` (the gate around
another model: a shipped model's name or an `.onnx` path), or a path to an `.onnx` file. Shipped models are found
next to this module, so names work from an installed package or image as from a checkout.
"""

from __future__ import annotations

from pathlib import Path

from routewise_vllm.router.policy.base import Policy
from routewise_vllm.router.policy.baselines import BASELINE_CLASSES
from routewise_vllm.router.policy.peers import PEER_CLASSES

# routewise's own heuristics, then the peers' algorithms (router/policy/peers, docs/peers.md)
BASELINES: dict[str, type[Policy]] = {cls.name: cls for cls in BASELINE_CLASSES + PEER_CLASSES}
PEER_BASELINES: tuple[str, ...] = tuple(cls.name for cls in PEER_CLASSES)
# What a learned policy is trained and selected against: every baseline of its own but random, which never wins, and
# lora-affinity, which is least-outstanding on a fleet without LoRA adapters (every fleet the models train on). The
# peers' algorithms are compared with, not trained against: the shipped models were selected on this list.
COMPARED_BASELINES: tuple[str, ...] = tuple(
    name for name in BASELINES if name not in ("random", "lora-affinity") and name not in PEER_BASELINES)
LEARNED = "learned"
MODELS_DIR = Path(__file__).parent / "models"
# The best measured configuration (docs/model-card-default.md): any-fleet.onnx behind late binding.
RECOMMENDED_MODEL = "any-fleet"
DEFAULT_MODEL_PATH = MODELS_DIR / f"{RECOMMENDED_MODEL}.onnx"  # what `learned` loads, live and simulated
# `learned` where the measured speed spread says replicas differ, a heuristic on uniform pools (router/policy/gated.py)
GATED = "gated"
# `gated:MODEL`: the gate around MODEL instead of the recommended model (e.g. gated:cache-fleet, docs/peers.md)
GATED_PREFIX = f"{GATED}:"
#: What `router serve` serves when given no policy (docs/model-card-default.md, docs/peers.md "The gate")
DEFAULT_POLICY = GATED


def shipped_models() -> dict[str, Path]:
    """Every model shipped in router/policy/models/, by name (its file's stem)."""
    return {p.stem: p for p in sorted(MODELS_DIR.glob("*.onnx"))}


def policy_names(include_learned: bool = True) -> list[str]:
    return list(BASELINES) + ([LEARNED, GATED, *shipped_models()] if include_learned else [])


def is_gated(name: str) -> bool:
    """`gated` or `gated:MODEL`: a model served behind the gate."""
    return name == GATED or name.startswith(GATED_PREFIX)


def model_path(name: str) -> Path | None:
    """The model file a learned policy name loads (`learned`, `gated`, `gated:MODEL`, a shipped model's name or an
    .onnx path); None for anything else (a baseline, an unknown name)."""
    if name in (LEARNED, GATED):
        return DEFAULT_MODEL_PATH
    if name.startswith(GATED_PREFIX):
        inner = name[len(GATED_PREFIX):]
        return None if is_gated(inner) else model_path(inner)
    if name.endswith(".onnx"):
        return Path(name)
    return shipped_models().get(name)


def is_learned(name: str) -> bool:
    return name not in BASELINES and model_path(name) is not None


def make_policy(name: str, seed: int | None = None, **kwargs) -> Policy:
    """A baseline by name, `learned` (the recommended shipped model), a shipped model's name, or an `.onnx` path."""
    if name in BASELINES:
        return BASELINES[name](seed=seed, **kwargs)
    path = model_path(name)
    if path is not None:
        return model_policy(name, path, seed=seed, **kwargs)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(policy_names())} or a path to an .onnx file")


def model_policy(name: str, path: Path, seed: int | None = None, **kwargs) -> Policy:
    """The learned policy `name` names, its model read from `path`: for `gated`, the gate around it; otherwise the
    model alone. A hot reload (router.serving.reload) builds the same kind from the new file, so a gated router stays
    gated."""
    from routewise_vllm.router.policy.onnx_policy import OnnxPolicy  # onnxruntime only when asked for

    if is_gated(name):
        return served_as(name, OnnxPolicy(path, seed=seed), seed=seed, **kwargs)
    return OnnxPolicy(path, seed=seed, **kwargs)


def served_as(name: str, model: Policy, seed: int | None = None, **kwargs) -> Policy:
    """A learned policy already built (`model`; a gate's own model when it is a gate) served as `name` serves its
    model: inside a new gate for `gated` and `gated:MODEL`, alone otherwise. An A/B promotion hands the treatment's
    model to the control arm this way, so a gated control stays gated."""
    from routewise_vllm.router.policy.gated import GATE_HEURISTIC, GatedPolicy

    learned = model.learned if isinstance(model, GatedPolicy) else model
    if is_gated(name):
        return GatedPolicy(learned, BASELINES[GATE_HEURISTIC](seed=seed), seed=seed, **kwargs)
    return learned


def check_policy_name(value: str, field: str) -> str:
    """A baseline name, `learned`, `gated`, `gated:MODEL`, a shipped model's name, or the path of an existing `.onnx`
    file."""
    if value in BASELINES or value in (LEARNED, GATED) or value in shipped_models():
        return value
    if value.startswith(GATED_PREFIX):
        inner = value[len(GATED_PREFIX):]
        if inner in BASELINES or is_gated(inner) or model_path(inner) is None:
            raise ValueError(f"{field}={value!r}: the gate serves a model, a shipped model's name ("
                             f"{', '.join(shipped_models())}) or an .onnx path, not {inner!r}")
        check_policy_name(inner, field)
        return value
    if value.endswith(".onnx"):
        if not Path(value).is_file():
            raise ValueError(f"{field}={value!r}: model file not found")
        return value
    raise ValueError(f"{field}={value!r}: unknown policy; known: {', '.join(policy_names())} or a path to an .onnx file")
