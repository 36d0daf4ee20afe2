#!/bin/bash
# Keep what a device machine compiled between machines. Each machine starts bare:
# - Triton's cache: without it the first engine compiles vLLM's GDN prefill kernels (~100 s at
#   Qwen3.6-27B shapes on an H100, 2026-12-05) and the next dflash_tfm engine ours (~30
#   kernels, 1-6 s each).
# - vLLM's compile cache (torch.compile's products, keyed by the whole vLLM config): without it
#   an engine under vLLM's default compilation starts in ~360 s, with it in ~25 s (H100,
#   2026-12-05: Dynamo + Inductor 63 s and Inductor's first "profiling/warmup" run 111 s, kept
#   by the cache; BENCHMARKS.md, "Stop 27"); with it travel vLLM's model-class inspections
#   (modelinfos/), ~28 s a model class in a fresh machine's first engine without them.
#
#   bash tools/gpu_vllm/device_caches.sh save $OUT/cache          # device, end of a call
#   bash tools/gpu_vllm/device_caches.sh merge /work/.device/N/cache_*.tar.xz.*   # here
#
# save: each cache's entries this machine made since setup.sh unpacked the carried ones (all of
#       them if none was carried), each as one xz tar cut into 15 MiB parts (a file back from $OUT
#       holds 16 MiB): PREFIX_triton.tar.xz.NN, PREFIX_compile.tar.xz.NN. The compile cache is
#       left out, with its sizes printed, past MAX_COMPILE_PARTS parts (default 1): the payload
#       (~22 MB), the tracked tree (~18 MB) and the caches share the 64 MiB a call carries.
# merge: adds the returned entries (PREFIX_triton.* to the payload's triton_cache.tar.xz,
#       PREFIX_compile.* to its compile_cache.tar.xz), which the next call carries, and copies
#       both to artifacts/gpu_vllm/<cache>_<vLLM version>.tar.xz, where build_payload.sh takes
#       them when it rebuilds the payload.
# xz, not gzip: compiled kernels shrink 3x more (a 334 MB Triton cache: 23 MB at -6 against 75).
set -euo pipefail
PAYLOAD=${PAYLOAD:-.gpu-vllm-0.33.0}
TRITON_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
VLLM_DIR=${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}

# pack ROOT LIST PREFIX MAX_PARTS: the entries in file LIST (paths under ROOT) as one xz tar
# stream cut into PREFIX.tar.xz.NN parts of 15 MiB; none past MAX_PARTS parts (returns 1).
pack() {
  local root=$1 list=$2 prefix=$3 max=$4
  rm -f "$prefix".tar.xz.*
  [ -s "$list" ] || return 0
  tar -cf - -C "$root" -T "$list" | xz -9 -T0 | split -b 15M -d - "$prefix.tar.xz."
  if [ "$(ls "$prefix".tar.xz.* | wc -l)" -gt "$max" ]; then rm -f "$prefix".tar.xz.*; return 1; fi
}

# new_entries ROOT DEPTH TYPE: paths (relative to ROOT) of the entries of find's TYPE (d, f)
# DEPTH levels down made since setup.sh unpacked the carried cache into ROOT (tar keeps the
# archive's times, older than .carried).
new_entries() {
  local newer=()
  [ -f "$1/.carried" ] && newer=(-newer "$1/.carried")
  [ -d "$1" ] || return 0
  (cd "$1" && find . -mindepth "$2" -maxdepth "$2" -type "$3" "${newer[@]}" | sed 's|^\./||')
}

# merge_into CARRIED PARTS...: CARRIED (a .tar.xz in the payload) becomes the union of itself
# and the archive the returned PARTS (X.tar.xz.00, X.tar.xz.01, ... of one or more X) make up;
# a copy goes to artifacts/gpu_vllm/.
merge_into() {
  local carried=$1 work stream
  shift
  work=$(mktemp -d)
  if [ -f "$carried" ]; then tar -xf "$carried" -C "$work"; fi
  for stream in $(printf '%s\n' "$@" | sed 's/\.[0-9]*$//' | sort -u); do
    cat "$stream".[0-9]* | tar -xJf - -C "$work"
  done
  tar -cf - -C "$work" . | xz -9 -T0 > "$carried"
  mkdir -p artifacts/gpu_vllm
  cp "$carried" "artifacts/gpu_vllm/$(basename "$carried" .tar.xz)_$(cat "$PAYLOAD/VLLM_VERSION").tar.xz"
  echo "$(basename "$carried"): $(du -h "$carried" | cut -f1)"
  rm -rf "$work"
}

case "${1:-}" in
  save)
    new_entries "$TRITON_DIR" 1 d > /tmp/triton_new
    pack "$TRITON_DIR" /tmp/triton_new "${2}_triton" 99
    echo "triton cache: $(wc -l < /tmp/triton_new) new entries"
    # vLLM's entries: torch_compile_cache/<config hash>, torch_aot_compile/<hash>, and the
    # model classes' inspections (modelinfos/*.json: without them each new process inspects
    # every model class in a subprocess, ~28 s each on a fresh H100).
    { new_entries "$VLLM_DIR" 2 d | grep -E '^torch_(compile_cache|aot_compile)/' || true
      new_entries "$VLLM_DIR" 2 f | grep -E '^modelinfos/.*\.json$' || true; } > /tmp/compile_new
    if pack "$VLLM_DIR" /tmp/compile_new "${2}_compile" "${MAX_COMPILE_PARTS:-1}"; then
      echo "compile cache: $(wc -l < /tmp/compile_new) new entries"
    else
      echo "compile cache: $(wc -l < /tmp/compile_new) new entries, over ${MAX_COMPILE_PARTS:-1} parts of 15 MiB: left out"
      (cd "$VLLM_DIR" && du -sh $(cat /tmp/compile_new)) || true
    fi
    ls -la "$(dirname "$2")" | grep -F "$(basename "$2")_" || true ;;
  merge)
    triton=() compile=()
    for returned in "${@:2}"; do
      case "$(basename "$returned")" in
        *_triton.tar.xz.[0-9]*) triton+=("$returned") ;;
        *_compile.tar.xz.[0-9]*) compile+=("$returned") ;;
        *) echo "device_caches.sh merge: $returned is no PREFIX_triton.tar.xz.NN or PREFIX_compile.tar.xz.NN part" >&2
           exit 2 ;;
      esac
    done
    if [ ${#triton[@]} -gt 0 ]; then merge_into "$PAYLOAD/triton_cache.tar.xz" "${triton[@]}"; fi
    if [ ${#compile[@]} -gt 0 ]; then merge_into "$PAYLOAD/compile_cache.tar.xz" "${compile[@]}"; fi
    echo "payload $(du -sh "$PAYLOAD" | cut -f1); a call carries it with the tracked tree (64 MiB in all)" ;;
  *) echo "usage: device_caches.sh save OUT_PREFIX | merge RETURNED.tar.xz..." >&2; exit 2 ;;
esac
