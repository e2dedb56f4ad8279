# Podman where there is no Docker daemon and no image registry (Debian 12 as root, as on CI machines).
# Source it from bash:
#   . scripts/podman-env.sh     # installs podman, runc and mmdebstrap if missing; exports CONTAINERS_CONF
#   routewise_base_image        # makes localhost/routewise-base:bookworm from Debian's packages unless present
#   podman build "${ROUTEWISE_BUILD_FLAGS[@]}" -f deploy/docker/Dockerfile.router -t routewise-router:0.1.0 .
# scripts/podman-images.sh does all of it. ROUTEWISE_PODMAN_DIR chooses where containers.conf is written
# (default: a new temporary folder). With a registry and a working default runtime, none of this is needed.

ROUTEWISE_BASE_IMAGE=${ROUTEWISE_BASE_IMAGE:-localhost/routewise-base:bookworm}

routewise_podman_install() {
  local missing=()
  command -v podman >/dev/null || missing+=(podman)
  command -v runc >/dev/null || [ -x /usr/sbin/runc ] || missing+=(runc)
  command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
  [ ${#missing[@]} = 0 ] && return 0
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  echo "podman-env: installing ${missing[*]}" >&2
  local try
  for try in 1 2 3 4 5 6; do  # another apt-get on the machine holds its lock for a while: wait for it, not fail
    $sudo apt-get -o DPkg::Lock::Timeout=60 update -qq >&2 \
      && DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=60 install -y -qq "${missing[@]}" >&2 \
      && return 0
    [ "$try" = 6 ] || sleep 10
  done
  return 1
}

# Why each setting: inside this kind of sandbox the runtime may not raise RLIMIT_NOFILE, so podman must not ask
# for default ulimits (else runc: "error setting rlimit type 7: operation not permitted"); runc, because crun
# refused some of these hosts' hybrid cgroup layout; cgroupfs, because no systemd manages the cgroups.
routewise_podman_conf() {
  local dir=${ROUTEWISE_PODMAN_DIR:-$(mktemp -d -t routewise-podman.XXXXXX)}
  mkdir -p "$dir"
  cat >"$dir/containers.conf" <<'EOF'
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
EOF
  export CONTAINERS_CONF="$dir/containers.conf"
}

# The Dockerfiles' default base, python:3.11-slim-bookworm, lives on an image registry; this is the same
# Debian release and Python minor version, made from Debian's packages (~250 MB, ~40 s on an idle machine).
routewise_base_image() {
  podman image exists "$ROUTEWISE_BASE_IMAGE" && return 0
  local tar
  tar=$(mktemp -t routewise-base.XXXXXX.tar)
  echo "podman-env: making $ROUTEWISE_BASE_IMAGE with mmdebstrap" >&2
  mmdebstrap --quiet --variant=minbase \
    --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates bookworm "$tar" >&2 \
    && podman import --quiet "$tar" "$ROUTEWISE_BASE_IMAGE" >/dev/null
  local rc=$?
  rm -f "$tar"
  return $rc
}

# For `podman build`: the host's network (RUN steps reach the package registries as the host does), the host's
# CA certificates (pip inside the build trusts what the host's pip trusts), the docker image format (the OCI
# format drops HEALTHCHECK) and the local base image.
ROUTEWISE_BUILD_FLAGS=(--network host --format docker -v /etc/ssl/certs:/etc/ssl/certs:ro
  --build-arg "PYTHON_IMAGE=$ROUTEWISE_BASE_IMAGE")

routewise_podman_install && routewise_podman_conf
