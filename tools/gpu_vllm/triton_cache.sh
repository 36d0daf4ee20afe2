#!/bin/bash
# Keep Triton's compiled kernels between device machines. Each machine starts bare: without a
# carried cache its first engine compiles vLLM's GDN prefill kernels (~100 s at Qwen3.6-27B
# shapes on an H100, 2026-12-05) and the next dflash_tfm engine ours (~30 kernels, 1-6 s
# each), minutes of a 30-minute session.
#
#   bash tools/gpu_vllm/triton_cache.sh save $OUT/triton_cache         # device, end of a call
#   bash tools/gpu_vllm/triton_cache.sh merge /work/.device/N/triton_cache.*.tar.xz   # here
#
# save: the cache entries this machine compiled since setup.sh unpacked the carried cache
#       (all of them if none was carried), as PREFIX.00.tar.xz, PREFIX.01.tar.xz, ... of at
#       most 15 MiB each.
# merge: adds the returned entries (.tar.xz or older .tgz) to the payload's
#       triton_cache.tar.xz (carried by the next call) and to
#       artifacts/gpu_vllm/triton_cache_<vLLM version>.tar.xz, which build_payload.sh takes
#       when it rebuilds the payload.
# xz, not gzip: compiled kernels shrink 3x more (a 334 MB cache: 23 MB at -6 against 75), and the
# cache shares the 64 MiB a call carries with the payload and the tracked tree.
set -euo pipefail
PAYLOAD=${PAYLOAD:-.gpu-vllm-0.33.0}
case "${1:-}" in
  save)
    TC=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
    newer=()
    [ -f "$TC/.carried" ] && newer=(-newer "$TC/.carried")
    find "$TC" -mindepth 1 -maxdepth 1 -type d "${newer[@]}" -printf '%f\n' > /tmp/triton_new
    # A file back from $OUT may hold 16 MiB: as many parts as keep each under 15 MiB (a
    # fresh machine's run_v2_tree.sh stages compiled 49 MiB of gzip).
    parts=1
    while :; do
      rm -f "$2".*.tar.xz /tmp/triton_part_*
      split -n "l/$parts" -d /tmp/triton_new /tmp/triton_part_
      for list in /tmp/triton_part_*; do tar -cf - -C "$TC" -T "$list" | xz -9 -T0 > "$2.${list##*_}.tar.xz"; done
      [ -z "$(find "$(dirname "$2")" -maxdepth 1 -name "$(basename "$2").*.tar.xz" -size +15M)" ] && break
      parts=$((parts + 1))
    done
    echo "triton cache: $(wc -l < /tmp/triton_new) new entries in $parts parts, $(du -ch "$2".*.tar.xz | tail -1 | cut -f1)" ;;
  merge)
    V=$(cat "$PAYLOAD/VLLM_VERSION")
    work=$(mktemp -d)
    carried=$PAYLOAD/triton_cache.tar.xz
    for old in "$carried" "$PAYLOAD/triton_cache.tgz"; do
      if [ -f "$old" ]; then tar -xf "$old" -C "$work"; fi
    done
    for returned in "${@:2}"; do tar -xf "$returned" -C "$work"; done
    rm -f "$PAYLOAD/triton_cache.tgz"
    tar -cf - -C "$work" . | xz -9 -T0 > "$carried"
    mkdir -p artifacts/gpu_vllm && cp "$carried" "artifacts/gpu_vllm/triton_cache_$V.tar.xz"
    echo "triton cache: $(ls "$work" | wc -l) entries, $(du -h "$carried" | cut -f1)"
    rm -rf "$work" ;;
  *) echo "usage: triton_cache.sh save OUT_PREFIX | merge RETURNED.tar.xz..." >&2; exit 2 ;;
esac
