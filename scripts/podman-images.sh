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

routewise_base_image
for image in "$@"; do
  start=$SECONDS
  case $image in
    base) continue ;;
    router)
      podman build "${ROUTEWISE_BUILD_FLAGS[@]}" -f deploy/docker/Dockerfile.router -t "routewise-router:$TAG" . ;;
    emulator)
      podman build "${ROUTEWISE_BUILD_FLAGS[@]}" --build-arg 'EXTRAS=[sim]' \
        -f deploy/docker/Dockerfile.router -t "routewise-emulator:$TAG" . ;;
    trainer)
      wheels=${TORCH_WHEELS:-/opt/wheels}
      extra=()
      if compgen -G "$wheels/torch-*.whl" >/dev/null; then
        extra=(-v "$wheels:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels)
      fi
      podman build "${ROUTEWISE_BUILD_FLAGS[@]}" "${extra[@]}" \
        -f deploy/docker/Dockerfile.trainer -t "routewise-trainer:$TAG" . ;;
    *) echo "podman-images: unknown image '$image' (router, emulator or trainer)" >&2; exit 2 ;;
  esac
  echo "podman-images: routewise-$image:$TAG built in $((SECONDS - start)) s" >&2
done
