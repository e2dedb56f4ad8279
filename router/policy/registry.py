"""Policy names to policies. Unknown names raise, listing the known ones.

A policy is a baseline by name, a shipped model by name (the stem of a file in router/policy/models/:
`late-fleet`, `any-fleet`, `default`), `learned` (the recommended shipped model, RECOMMENDED_MODEL), or a
path to an `.onnx` file. Shipped models are found next to this module, so names work from an installed
package or image as from a checkout.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from router.policy.base import Policy
from router.policy.baselines import BASELINE_CLASSES

BASELINES: dict[str, type[Policy]] = {cls.name: cls for cls in BASELINE_CLASSES}
# What a learned policy is measured and selected against: every baseline but random, which never wins.
COMPARED_BASELINES: tuple[str, ...] = tuple(name for name in BASELINES if name != "random")
LEARNED = "learned"
MODELS_DIR = Path(__file__).parent / "models"
# The best measured configuration (docs/model-card-default.md): late-fleet.onnx behind late binding.
RECOMMENDED_MODEL = "late-fleet"
DEFAULT_MODEL_PATH = MODELS_DIR / f"{RECOMMENDED_MODEL}.onnx"  # what `learned` loads, live and simulated


def shipped_models() -> dict[str, Path]:
    """Every model shipped in router/policy/models/, by name (its file's stem)."""
    return {p.stem: p for p in sorted(MODELS_DIR.glob("*.onnx"))}


def policy_names(include_learned: bool = True) -> list[str]:
    return list(BASELINES) + ([LEARNED, *shipped_models()] if include_learned else [])


def model_path(name: str) -> Path | None:
    """The model file a learned policy name loads (`learned`, a shipped model's name or an .onnx path); None for
    anything else (a baseline, an unknown name)."""
    if name == LEARNED:
        return DEFAULT_MODEL_PATH
    if name.endswith(".onnx"):
        return Path(name)
    return shipped_models().get(name)


def is_learned(name: str) -> bool:
    return name not in BASELINES and model_path(name) is not None


@cache
def _late_binding_of(path: Path, mtime_ns: int) -> bool:
    """The training configuration's env.late_binding: from the card (the .json beside the model, as `trainer export
    --card` writes it), else from the model's own metadata (`training_config`, kept by a copy of the file alone)."""
    try:
        config = json.loads(path.with_suffix(".json").read_text())["training"]["config"]
    except (OSError, ValueError, KeyError, TypeError):
        try:
            import onnxruntime as ort

            meta = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_modelmeta()
            config = json.loads(meta.custom_metadata_map.get("training_config", "{}"))
        except Exception:  # noqa: BLE001 - a model that does not load is reported where it is loaded
            return False
    try:
        return bool(config["env"].get("late_binding", False))
    except (KeyError, TypeError, AttributeError):
        return False


def trained_behind_late_binding(name: str) -> bool:
    """True for a model trained behind late binding (its training configuration's env.late_binding): served at its
    best with late binding on."""
    path = model_path(name)
    if path is None or name in BASELINES:
        return False
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return False
    return _late_binding_of(path, mtime)


def make_policy(name: str, seed: int | None = None, **kwargs) -> Policy:
    """A baseline by name, `learned` (the recommended shipped model), a shipped model's name, or an `.onnx` path."""
    if name in BASELINES:
        return BASELINES[name](seed=seed, **kwargs)
    path = model_path(name)
    if path is not None:
        from router.policy.onnx_policy import OnnxPolicy  # onnxruntime only when asked for

        return OnnxPolicy(path, seed=seed, **kwargs)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(policy_names())} or a path to an .onnx file")
