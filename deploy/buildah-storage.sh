#!/usr/bin/env bash
# Prints the storage options for buildah (used by build-image.sh, local-base.sh and the image
# test): $BUILDAH_OPTS when set; else `--storage-driver overlay` where the kernel's overlay
# filesystem mounts here (a build then copies only what a step changed), else
# `--storage-driver vfs` (a full copy of the tree for every layer and container: works
# everywhere, several times slower). The two drivers keep separate images in one storage root,
# so a machine that built with vfs before builds its cache once more with overlay.
set -euo pipefail
if [ -n "${BUILDAH_OPTS:-}" ]; then
  echo "$BUILDAH_OPTS"
  exit 0
fi
probe() {  # a scratch container mounted and removed: the driver works end to end
  local ctr
  ctr=$(buildah --storage-driver "$1" from scratch 2>/dev/null) || return 1
  local ok=0
  buildah --storage-driver "$1" mount "$ctr" >/dev/null 2>&1 || ok=1
  buildah --storage-driver "$1" rm "$ctr" >/dev/null 2>&1 || true
  return $ok
}
if probe overlay; then
  echo "--storage-driver overlay"
else
  echo "--storage-driver vfs"
fi
