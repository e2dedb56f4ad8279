#!/usr/bin/env bash
# Builds routewise's images with podman on a machine without a Docker daemon or an image registry:
#   scripts/podman-images.sh [base] [router] [emulator] [trainer]     (default: router)
#     base      localhost/routewise-base:bookworm, made with mmdebstrap unless present (every build needs it)
#     router    routewise-router:0.1.0     deploy/docker/Dockerfile.router
#     emulator  routewise-emulator:0.1.0   the same with EXTRAS=[sim] (`fleet emulate`, for docker-compose.cpu.yml)
#     trainer   routewise-trainer:0.1.0    deploy/docker/Dockerfile.trainer
# Installs podman, runc and mmdebstrap if missing and makes the base image first (scripts/podman-env.sh). Layers
# are cached: a rebuild without source changes takes seconds. TAG=... changes the tag.
# The trainer build takes torch from a local folder of wheels when TORCH_WHEELS names one (default /opt/wheels
# when it holds a torch wheel), else from the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/podman-env.sh
TAG=${TAG:-0.1.0}
[ $# -gt 0 ] || set -- router

# build REF ARGS...: podman build tagged REF; the image REF named before is removed once REF names another (with
# its untagged parents), so rebuilds after source changes do not pile up old layers. The router's build stage is
# tagged too (REF-build), which keeps its cached layers from looking like leftovers.
build() {
  local ref=$1 old new
  shift
  old=$(podman image inspect --format '{{.Id}}' "$ref" 2>/dev/null || true)
  podman build "${ROUTEWISE_BUILD_FLAGS[@]}" -t "$ref" "$@" "$context"
  new=$(podman image inspect --format '{{.Id}}' "$ref")
  if [ -n "$old" ] && [ "$old" != "$new" ]; then podman rmi "$old" >/dev/null 2>&1 || true; fi
}

# One snapshot of the checkout for every build of this run (what git tracks or would: no venvs, no in-place
# builds), so the images of one run come from the same sources even while the tree is being edited.
context=.
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  context=$(mktemp -d -t routewise-context.XXXXXX)
  trap 'rm -rf "$context"' EXIT
  git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done \
    | tar -c --null -T - | tar -x -C "$context"
fi

routewise_base_image
for image in "$@"; do
  start=$SECONDS
  case $image in
    base) continue ;;
    router|emulator)
      extras=()
      [ "$image" = router ] || extras=(--build-arg 'EXTRAS=[sim]')
      build "routewise-$image-build:$TAG" --target build "${extras[@]}" -f "$context/deploy/docker/Dockerfile.router"
      build "routewise-$image:$TAG" "${extras[@]}" -f "$context/deploy/docker/Dockerfile.router" ;;
    trainer)
      wheels=${TORCH_WHEELS:-/opt/wheels}
      extra=()
      if compgen -G "$wheels/torch-*.whl" >/dev/null; then
        extra=(-v "$wheels:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels)
      fi
      build "routewise-trainer:$TAG" "${extra[@]}" -f "$context/deploy/docker/Dockerfile.trainer" ;;
    *) echo "podman-images: unknown image '$image' (router, emulator or trainer)" >&2; exit 2 ;;
  esac
  echo "podman-images: routewise-$image:$TAG built in $((SECONDS - start)) s" >&2
done
