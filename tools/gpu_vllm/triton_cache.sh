#!/bin/bash
# Keep Triton's compiled kernels between device machines. Each machine starts bare: without a
# carried cache its first engine compiles vLLM's GDN prefill kernels (~100 s at Qwen3.6-27B
# shapes on an H100, 2026-12-05) and the next dflash_tfm engine ours (~30 kernels, 1-6 s
# each), minutes of a 30-minute session.
#
#   bash tools/gpu_vllm/triton_cache.sh save $OUT/triton_cache.tgz     # device, end of a call
#   bash tools/gpu_vllm/triton_cache.sh merge /work/.device/N/triton_cache.tgz   # here
#
# save: the cache entries this machine compiled since setup.sh unpacked the carried cache
#       (all of them if none was carried).
# merge: adds the returned entries to the payload's triton_cache.tgz (carried by the next
#       call) and to artifacts/gpu_vllm/triton_cache_<vLLM version>.tgz, which
#       build_payload.sh takes when it rebuilds the payload.
set -euo pipefail
PAYLOAD=${PAYLOAD:-.gpu-vllm-0.33.0}
case "${1:-}" in
  save)
    TC=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
    newer=()
    [ -f "$TC/.carried" ] && newer=(-newer "$TC/.carried")
    find "$TC" -mindepth 1 -maxdepth 1 -type d "${newer[@]}" -printf '%f\n' > /tmp/triton_new
    tar -czf "$2" -C "$TC" -T /tmp/triton_new
    echo "triton cache: $(wc -l < /tmp/triton_new) new entries, $(du -h "$2" | cut -f1)" ;;
  merge)
    V=$(cat "$PAYLOAD/VLLM_VERSION")
    work=$(mktemp -d)
    [ -f "$PAYLOAD/triton_cache.tgz" ] && tar -xzf "$PAYLOAD/triton_cache.tgz" -C "$work"
    for returned in "${@:2}"; do tar -xzf "$returned" -C "$work"; done
    tar -czf "$PAYLOAD/triton_cache.tgz" -C "$work" .
    mkdir -p artifacts/gpu_vllm && cp "$PAYLOAD/triton_cache.tgz" "artifacts/gpu_vllm/triton_cache_$V.tgz"
    echo "triton cache: $(ls "$work" | wc -l) entries, $(du -h "$PAYLOAD/triton_cache.tgz" | cut -f1)"
    rm -rf "$work" ;;
  *) echo "usage: triton_cache.sh save OUT.tgz | merge RETURNED.tgz..." >&2; exit 2 ;;
esac
