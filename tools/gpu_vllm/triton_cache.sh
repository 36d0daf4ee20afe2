#!/bin/bash
# Keep Triton's compiled kernels between device machines. Each machine starts bare: without a
# carried cache its first engine compiles vLLM's GDN prefill kernels (~100 s at Qwen3.6-27B
# shapes on an H100, 2026-12-05) and the next dflash_tfm engine ours (~30 kernels, 1-6 s
# each), minutes of a 30-minute session.
#
#   bash tools/gpu_vllm/triton_cache.sh save $OUT/triton_cache         # device, end of a call
#   bash tools/gpu_vllm/triton_cache.sh merge /work/.device/N/triton_cache.*.tgz   # here
#
# save: the cache entries this machine compiled since setup.sh unpacked the carried cache
#       (all of them if none was carried), as PREFIX.00.tgz, PREFIX.01.tgz, ... of at most
#       15 MiB each.
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
    # A file back from $OUT may hold 16 MiB: as many parts as keep each under 15 MiB (a
    # fresh machine's bench_speed run compiled 17 MiB; run_v2_tree.sh's stages 39 MiB).
    parts=1
    while :; do
      rm -f "$2".*.tgz /tmp/triton_part_*
      split -n "l/$parts" -d /tmp/triton_new /tmp/triton_part_
      for list in /tmp/triton_part_*; do tar -czf "$2.${list##*_}.tgz" -C "$TC" -T "$list"; done
      [ -z "$(find "$(dirname "$2")" -maxdepth 1 -name "$(basename "$2").*.tgz" -size +15M)" ] && break
      parts=$((parts + 1))
    done
    echo "triton cache: $(wc -l < /tmp/triton_new) new entries in $parts parts, $(du -ch "$2".*.tgz | tail -1 | cut -f1)" ;;
  merge)
    V=$(cat "$PAYLOAD/VLLM_VERSION")
    work=$(mktemp -d)
    [ -f "$PAYLOAD/triton_cache.tgz" ] && tar -xzf "$PAYLOAD/triton_cache.tgz" -C "$work"
    for returned in "${@:2}"; do tar -xzf "$returned" -C "$work"; done
    tar -czf "$PAYLOAD/triton_cache.tgz" -C "$work" .
    mkdir -p artifacts/gpu_vllm && cp "$PAYLOAD/triton_cache.tgz" "artifacts/gpu_vllm/triton_cache_$V.tgz"
    echo "triton cache: $(ls "$work" | wc -l) entries, $(du -h "$PAYLOAD/triton_cache.tgz" | cut -f1)"
    rm -rf "$work" ;;
  *) echo "usage: triton_cache.sh save OUT_PREFIX | merge RETURNED.tgz..." >&2; exit 2 ;;
esac
