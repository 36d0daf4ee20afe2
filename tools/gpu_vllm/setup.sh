#!/bin/bash
# Install the carried payload on the GPU machine (idempotent; ~10-20 s on a fresh machine).
#   /tmp/site   <- whl/*.whl (pip --target, no deps, no index)
#   /tmp/vsrc   <- vllm_py.tgz (patched pure-Python vLLM, the version in VLLM_VERSION; another
#                  version staged earlier on this machine is replaced)
#   compileall both trees with 16 workers (so no process compiles bytecode at import time)
#   ${VLLM_CACHE_ROOT:-~/.cache/vllm}/modelinfos <- modelinfos/*.json (skips the registry subprocess)
#   ${TRITON_CACHE_DIR:-~/.triton/cache} <- triton_cache.tar.xz (or .tgz) if carried (skips Triton JIT +
#                  autotuning)
#   ${VLLM_CACHE_ROOT:-~/.cache/vllm} <- compile_cache.tar.xz if carried (vLLM's torch.compile cache:
#                  skips Dynamo, Inductor and Inductor's first run for the configs it holds)
#   (device_caches.sh save, at the end of a call, returns what the machine added to either)
#   $TINY (/tmp/tiny) <- tiny.tgz if carried, else built with make_tiny.py
set -e
cd "$(dirname "$0")"
S=$SECONDS
if [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site whl/*.whl
  touch /tmp/site/.done
fi
V=$(cat VLLM_VERSION)
if [ "$(cat /tmp/vsrc/.done 2>/dev/null)" != "$V" ]; then
  rm -rf /tmp/vsrc && mkdir -p /tmp/vsrc && tar -xzf vllm_py.tgz -C /tmp/vsrc && echo "$V" > /tmp/vsrc/.done
fi
if [ ! -f /tmp/vsrc/.compiled ]; then
  python3 -m compileall -q -j "$(nproc)" /tmp/vsrc /tmp/site > /dev/null && touch /tmp/vsrc/.compiled
fi
MI=${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}/modelinfos
if [ -d modelinfos ]; then mkdir -p "$MI" && cp -n modelinfos/*.json "$MI"/ 2>/dev/null || true; fi
TC=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
for carried in triton_cache.tar.xz triton_cache.tgz; do
  if [ -f "$carried" ] && [ ! -f "$TC/.carried" ]; then
    mkdir -p "$TC" && tar -xf "$carried" -C "$TC" && touch "$TC/.carried"
  fi
done
VC=${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}
if [ -f compile_cache.tar.xz ] && [ ! -f "$VC/.carried" ]; then
  mkdir -p "$VC" && tar -xf compile_cache.tar.xz -C "$VC" && touch "$VC/.carried"
fi
TINY=${TINY:-/tmp/tiny}
if [ ! -f "$TINY/qwen35/config.json" ]; then
  if [ -f tiny.tgz ]; then mkdir -p "$TINY" && tar -xzf tiny.tgz -C "$TINY"
  else PYTHONPATH=/tmp/site python3 make_tiny.py "$TINY" | tail -1; fi
fi
echo "setup done in $((SECONDS - S)) s (vLLM $V)"
