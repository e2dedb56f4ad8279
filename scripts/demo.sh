#!/usr/bin/env bash
# routewise CPU demo (no GPU, no torch): emulated heterogeneous vLLM fleet + router (A/B: least-outstanding
# vs learned, late binding at the emulated replicas' 8 batch slots) + a real trace replayed through it; ends with
# TTFT/E2E percentiles per arm and what the router held. About 2 minutes.
#   ./scripts/demo.sh                               # defaults (see `--help`)
#   ./scripts/demo.sh --duration 30                 # shorter
#   ./scripts/demo.sh --late-binding-max-num-seqs 0 # without late binding
#   ./scripts/demo.sh --replica http://h1:8000 --replica http://h2:8000 --late-binding-max-num-seqs 256   # real vLLM servers
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# Install routewise with the simulator extra unless this checkout's package and its dependencies import (an existing
# .venv is reused).
if ! .venv/bin/python -c "import routewise_vllm.fleet.demo, zmq, msgspec, gymnasium" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check -e '.[sim]'
fi
# The demo reports which replica served each request: it needs the router's opt-in x-routewise-replica header.
export ROUTEWISE_REPLICA_HEADER=${ROUTEWISE_REPLICA_HEADER:-true}
exec .venv/bin/fleet demo "$@"
