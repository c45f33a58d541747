#!/usr/bin/env bash
# Builds the two base images deploy/Dockerfile needs from Debian's own packages, for machines that
# reach no image registry (buildah, no Docker engine): debootstrap of Debian 12 (bookworm) with
# python3 + python3-venv, and the same system plus Node 20 for the dashboard stage (Debian 12
# ships Node 18 and the dashboard needs >= 20.19, so node and npm come from this machine's own
# installation: /usr/bin/node and /usr/lib/node_modules/npm).
#
# Both carry this machine's CA bundle (/etc/ssl/certs/ca-certificates.crt), so that npm and pip
# in the build trust what this machine trusts.
#
# Prints two lines, `PYTHON_BASE=<image>` and `NODE_BASE=<image>`. The images are tagged with a
# key made of this script's hash and the Node version, and reused while the key holds: the
# debootstrap (minutes) runs once per machine; the .deb files are kept in
# ${HAI_BASE_CACHE:-/var/cache/hai-base} so even that first run downloads them once.
set -euo pipefail
BUILDAH=(buildah $("$(dirname "$0")/buildah-storage.sh"))  # overlay where it mounts, else vfs
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=${HAI_BASE_CACHE:-/var/cache/hai-base}
NODE_VERSION=$(node --version 2>/dev/null || true)
case "$NODE_VERSION" in
  v2[0-9].*|v[3-9][0-9].*) ;;
  *) echo "local-base.sh: needs Node >= 20 on this machine (found '${NODE_VERSION:-none}')" >&2; exit 1 ;;
esac
KEY=$( { cat "$0"; echo "$NODE_VERSION"; npm --version; cat /etc/ssl/certs/ca-certificates.crt; } | sha256sum | cut -c1-12)
PY_IMG=localhost/hai-base-python:bookworm-$KEY
NODE_IMG=localhost/hai-base-node:bookworm-$KEY

# one builder at a time per machine (several checkouts may ask at once)
mkdir -p "$CACHE"
exec 9>"$CACHE/lock"
flock 9

have() { "${BUILDAH[@]}" inspect --type image "$1" >/dev/null 2>&1; }

if ! have "$PY_IMG"; then
  mkdir -p "$CACHE/debs"
  root=$(mktemp -d "${TMPDIR:-/tmp}/hai-rootfs.XXXXXX")
  trap 'rm -rf "$root" "$root.tar"' EXIT
  echo "local-base.sh: debootstrap bookworm into $root" >&2
  debootstrap --variant=minbase --cache-dir="$CACHE/debs" \
    --include=python3,python3-venv,ca-certificates \
    bookworm "$root" "$MIRROR" >&2
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
  # this machine's trust store: where the network passes a TLS-inspecting proxy, npm and pip in
  # the build reach their registries only through it
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  # python:3.11-slim has `python`; make the same true here
  ln -sf python3 "$root/usr/bin/python"
  tar -C "$root" -cf "$root.tar" .
  ctr=$("${BUILDAH[@]}" from scratch)
  "${BUILDAH[@]}" add "$ctr" "$root.tar" / >/dev/null   # a local tar archive: added unpacked
  rm -f "$root.tar"
  "${BUILDAH[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt --cmd python3 "$ctr"
  "${BUILDAH[@]}" commit --rm "$ctr" "$PY_IMG" >&2
  rm -rf "$root"; trap - EXIT
fi

if ! have "$NODE_IMG"; then
  echo "local-base.sh: $NODE_IMG = $PY_IMG + this machine's Node $NODE_VERSION and npm" >&2
  nodetar=$(mktemp "${TMPDIR:-/tmp}/hai-node.XXXXXX.tar")
  trap 'rm -f "$nodetar"' EXIT
  # this machine's node binary and npm (as installed: npm may have updated itself since the
  # nodejs package put it there)
  tar -C / -cf "$nodetar" usr/bin/node usr/bin/npm usr/bin/npx usr/lib/node_modules/npm
  ctr=$("${BUILDAH[@]}" from "$PY_IMG")
  "${BUILDAH[@]}" add "$ctr" "$nodetar" / >/dev/null
  rm -f "$nodetar"; trap - EXIT
  "${BUILDAH[@]}" run --isolation "${BUILDAH_ISOLATION:-chroot}" "$ctr" node --version >&2
  "${BUILDAH[@]}" run --isolation "${BUILDAH_ISOLATION:-chroot}" "$ctr" npm --version >&2
  "${BUILDAH[@]}" config --env NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt --cmd node "$ctr"
  "${BUILDAH[@]}" commit --rm "$ctr" "$NODE_IMG" >&2
fi

echo "PYTHON_BASE=$PY_IMG"
echo "NODE_BASE=$NODE_IMG"
