# Sourced by scripts/test.sh and scripts/install-vllm.sh: `uv_install VENV PACKAGES...` installs into VENV through uv
# (itself installed into VENV by pip) with pip's own find-links and constraints, so torch still comes from the local
# CPU wheel. uv keeps what it downloaded and links it, where pip here downloads and unpacks every wheel again
# (real vLLM's venv: 13 s against 234 s). It compiles the bytecode as pip does: without it the first three vLLM
# servers, started at once, compiled vLLM's and torch's modules each on its own and took 210 s to start instead of
# 46 s. Returns non-zero when uv cannot install; the callers then use pip.
uv_install() {
  local venv=$1 args=() link constraint
  shift
  pip_setting() { "$venv/bin/pip" config get "global.$1" 2>/dev/null || true; }
  for link in ${PIP_FIND_LINKS:-$(pip_setting find-links)}; do args+=(--find-links "$link"); done
  for constraint in ${PIP_CONSTRAINT:-$(pip_setting constraint)}; do args+=(--constraint "$constraint"); done
  "$venv/bin/pip" install -q --disable-pip-version-check uv \
    && "$venv/bin/uv" pip install -q --compile-bytecode --python "$venv/bin/python" "${args[@]}" "$@"
}
