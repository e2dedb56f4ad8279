# Sourced by scripts/test.sh and scripts/install-vllm.sh: `uv_install [--compile-bytecode] VENV PACKAGES...` installs
# into VENV through uv (itself installed into VENV by pip) with pip's own find-links and constraints, so torch still
# comes from the local CPU wheel. uv keeps what it downloaded and links it, where pip here downloads and unpacks every
# wheel again (real vLLM's venv: 13 s against 234 s). --compile-bytecode compiles every module at install, as pip
# does: real vLLM's venv needs it (without it the first three vLLM servers, started at once, compiled vLLM's and
# torch's modules each on its own and took 210 s to start instead of 46 s); the test venv does not (30 s idle, about
# 57 s beside a busy core, for modules the tests mostly never import; scripts/test.sh lets Python write the bytecode
# of those they do, once, on first import). Returns non-zero when uv cannot install; the callers then use pip.
uv_install() {
  local compile=() args=() link constraint venv
  if [ "${1:-}" = --compile-bytecode ]; then compile=(--compile-bytecode); shift; fi
  venv=$1
  shift
  pip_setting() { "$venv/bin/pip" config get "global.$1" 2>/dev/null || true; }
  for link in ${PIP_FIND_LINKS:-$(pip_setting find-links)}; do args+=(--find-links "$link"); done
  for constraint in ${PIP_CONSTRAINT:-$(pip_setting constraint)}; do args+=(--constraint "$constraint"); done
  "$venv/bin/pip" install -q --disable-pip-version-check uv \
    && "$venv/bin/uv" pip install -q "${compile[@]}" --python "$venv/bin/python" "${args[@]}" "$@"
}
