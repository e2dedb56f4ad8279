"""The docs name the default the code serves: `gated`, which serves RECOMMENDED_MODEL behind its gate and late binding. A doc
that names another model as the default, or a file or name the code no longer has, fails here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from routewise_vllm.router.policy.registry import DEFAULT_MODEL_PATH, DEFAULT_POLICY, GATED, RECOMMENDED_MODEL, model_path, shipped_models
from routewise_vllm.router.settings import RouterSettings

ROOT = Path(__file__).resolve().parents[1]


def _docs() -> dict[str, str]:
    files = subprocess.run(["git", "ls-files", "*.md", "deploy/*.yaml"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    return {f: (ROOT / f).read_text() for f in files if (ROOT / f).is_file()}


def test_the_default_policy_is_the_recommended_model():
    assert RouterSettings.model_fields["policy"].default == DEFAULT_POLICY == GATED
    assert model_path(GATED) == DEFAULT_MODEL_PATH  # the gate serves the recommended model
    assert RECOMMENDED_MODEL in shipped_models()


def test_every_doc_that_names_the_default_model_names_the_recommended_one():
    pattern = re.compile(r"`([a-z0-9-]+)`[^.\n|]{0,40}\(the default model\)|the default model,? `([a-z0-9-]+)`")
    named = {(f, m.group(1) or m.group(2)) for f, text in _docs().items() for m in pattern.finditer(text)}
    assert named, "no doc names the default model: the pattern no longer matches how the docs say it"
    assert {name for _, name in named} == {RECOMMENDED_MODEL}, sorted(named)


def test_no_doc_names_a_model_file_that_is_not_shipped():
    shipped = set(shipped_models())
    stale = {(f, m) for f, text in _docs().items() for m in re.findall(r"policy/models/([a-z0-9-]+)\.onnx", text)
             if m not in shipped}
    assert stale == set()
