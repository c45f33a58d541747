#!/usr/bin/env bash
# `make image`: builds deploy/Dockerfile as ${HAI_IMAGE:-hai-platform:latest}, with Docker where an
# engine answers, else with buildah (no daemon: --isolation chroot; overlay storage where the kernel
# mounts it, else vfs: deploy/buildah-storage.sh, overridden by BUILDAH_OPTS).
#   PYTHON_BASE=... NODE_BASE=...   base images (the Dockerfile's defaults: python:3.11-slim, node:20-slim)
#   With buildah and neither set, the bases come from deploy/local-base.sh (Debian's packages, for
#   machines that reach no registry); HAI_LOCAL_BASE=0 uses the registry defaults instead.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${HAI_IMAGE:-hai-platform:latest}
args=(-f deploy/Dockerfile -t "$IMAGE")
[ -n "${PYTHON_BASE:-}" ] && args+=(--build-arg "PYTHON_BASE=$PYTHON_BASE")
[ -n "${NODE_BASE:-}" ] && args+=(--build-arg "NODE_BASE=$NODE_BASE")

if command -v docker >/dev/null 2>&1 && timeout 10 docker info >/dev/null 2>&1; then
  exec docker build "${args[@]}" .
fi
if ! command -v buildah >/dev/null 2>&1; then
  echo "make image: needs docker (with a running engine) or buildah (apt-get install buildah)" >&2
  exit 1
fi
BUILDAH_OPTS=$(deploy/buildah-storage.sh)
export BUILDAH_OPTS  # local-base.sh builds the bases in the same storage
if [ -z "${PYTHON_BASE:-}${NODE_BASE:-}" ] && [ "${HAI_LOCAL_BASE:-1}" != 0 ]; then
  bases=$(deploy/local-base.sh)
  eval "$bases"
  args+=(--build-arg "PYTHON_BASE=$PYTHON_BASE" --build-arg "NODE_BASE=$NODE_BASE")
fi
# shellcheck disable=SC2086
exec buildah $BUILDAH_OPTS build --isolation "${BUILDAH_ISOLATION:-chroot}" --layers "${args[@]}" .
