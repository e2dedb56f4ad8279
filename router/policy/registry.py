"""Policy names to policies. Unknown names raise, listing the known ones."""

from __future__ import annotations

from pathlib import Path

from router.policy.base import Policy
from router.policy.baselines import BASELINE_CLASSES

BASELINES: dict[str, type[Policy]] = {cls.name: cls for cls in BASELINE_CLASSES}
# What a learned policy is measured and selected against: every baseline but random, which never wins.
COMPARED_BASELINES: tuple[str, ...] = tuple(name for name in BASELINES if name != "random")
LEARNED = "learned"
DEFAULT_MODEL_PATH = Path(__file__).parent / "models" / "default.onnx"


def policy_names(include_learned: bool = True) -> list[str]:
    return list(BASELINES) + ([LEARNED] if include_learned else [])


def make_policy(name: str, seed: int | None = None, **kwargs) -> Policy:
    """A baseline by name, `learned` (the shipped ONNX model), or a path to an `.onnx` file."""
    if name in BASELINES:
        return BASELINES[name](seed=seed, **kwargs)
    if name == LEARNED or name.endswith(".onnx"):
        from router.policy.onnx_policy import OnnxPolicy  # onnxruntime only when asked for

        path = DEFAULT_MODEL_PATH if name == LEARNED else Path(name)
        return OnnxPolicy(path, seed=seed, **kwargs)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(policy_names())} or a path to an .onnx file")
