#!/usr/bin/env bash
# The container image's build time with buildah's two storage drivers (deploy/README.md):
# for each driver, in a storage root of its own under $DIR (removed afterwards), the bases
# (deploy/local-base.sh), the image on them without a layer cache, and a rebuild after a change
# under backend/ (a comment appended to backend/hai/__init__.py and put back).
#   benchmarks/image_build.sh [vfs] [overlay]     (default: both, vfs first)
# Needs root, buildah and debootstrap. The .deb files are cached in /var/cache/hai-base, so the
# first driver's bases may include their download.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${DIR:-/var/tmp/hai-image-bench}
drivers=("$@"); [ ${#drivers[@]} -gt 0 ] || drivers=(vfs overlay)
init=backend/hai/__init__.py
saved=$(mktemp); cp "$init" "$saved"
export HAI_IMAGE=localhost/hai-platform:image-bench
drv=""
drop() {  # the driver's storage root: its containers and images, then anything still mounted under it
  [ -n "$drv" ] || return 0
  buildah $BUILDAH_OPTS rm --all >/dev/null 2>&1 || true
  buildah $BUILDAH_OPTS rmi --all --force >/dev/null 2>&1 || true
  awk -v d="$DIR/$drv/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r | xargs -r umount -l
  rm -rf "$DIR/$drv"
}
trap 'cp "$saved" "$init"; rm -f "$saved"; drop; rm -rf "$DIR"' EXIT
secs() { local t0=$EPOCHREALTIME; "$@" >"$DIR/last.log" 2>&1 || { tail -20 "$DIR/last.log" >&2; exit 1; }; echo "$EPOCHREALTIME - $t0" | bc; }
for d in "${drivers[@]}"; do
  drv=$d
  rm -rf "$DIR/$drv"; mkdir -p "$DIR/$drv"
  export BUILDAH_OPTS="--storage-driver $drv --root $DIR/$drv/root --runroot $DIR/$drv/run"
  base=$(secs deploy/local-base.sh)
  build=$(secs deploy/build-image.sh)
  echo "# image_build.sh $(date -u +%FT%T)" >> "$init"
  rebuild=$(secs deploy/build-image.sh)
  cp "$saved" "$init"
  printf '%-8s bases %6.1f s   image (no layer cache) %6.1f s   rebuild after a backend change %6.1f s\n' "$drv" "$base" "$build" "$rebuild"
  drop
done
drv=""
