#!/bin/bash
# Run vLLM scenarios (the staged version) on the GPU machine, each under its own timeout, in parallel (SERIAL=1: one by one).
# usage: [TAG=name] [SERIAL=1] bash .probe/go.sh plain_v1:150 plain:150 hybrid:180 dflash:200 ...
# Logs -> /tmp/vlogs_$TAG/<scen>.log. $OUT gets summary_$TAG.txt and logs_$TAG.tgz, plus
# triton_cache.tgz and modelinfos.tgz (carry them on later calls: .probe/triton_cache.tgz, .probe/modelinfos/).
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1   # persist Triton autotune picks in the Triton cache too
export TINY=${TINY:-/tmp/tiny}
TAG=${TAG:-run}; L=/tmp/vlogs_$TAG
OUT=${OUT:-/tmp/vout}; mkdir -p "$OUT" "$L"
bash setup.sh || exit 1
export PYTHONPATH=/tmp/vsrc:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
run_one() {  # scen timeout
  local s=$1 to=$2 t; t=$(date +%s.%N)
  T_LAUNCH=$t timeout -k 5 "$to" python3 run_llm.py "$s" > "$L/$s.log" 2>&1
  echo "rc=$? $s wall=$(python3 -c "import time;print(round(time.time()-$t,1))")s" >> "$L/$s.log"
}
pids=()
for st in "$@"; do
  s=${st%%:*}; to=${st#*:}; [ "$to" = "$st" ] && to=${SCEN_TIMEOUT:-200}
  if [ -n "${SERIAL:-}" ]; then run_one "$s" "$to"; else run_one "$s" "$to" & pids+=($!); fi
done
[ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
for st in "$@"; do
  s=${st%%:*}; echo "================ $TAG/$s"
  grep -E "import torch|engine ready|GENERATE OK|SPEC|Using V2|Traceback|Error|rc=" "$L/$s.log" \
    | grep -v "^\s*$" | cut -c1-300 | tail -8
done
python3 compare.py "$L" | tee "$OUT/summary_$TAG.txt"
tar -czf "$OUT/logs_$TAG.tgz" -C /tmp "vlogs_$TAG"
MI=${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}; TC=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
ls -l --time-style=+%T "$MI/modelinfos" | tail -n +2 | awk '{print "modelinfo", $6, $7}'
tar -czf "$OUT/modelinfos.tgz" -C "$MI" modelinfos
tar -czf "$OUT/triton_cache.tgz" -C "$TC" --exclude=.carried . && du -h "$OUT/triton_cache.tgz"
