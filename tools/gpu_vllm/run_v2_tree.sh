#!/bin/bash
# dflash_tfm on model runner V2 (vLLM 0.33.0) on the H200, staged: a stage that fails still
# leaves the earlier stages' reports. Device call (repository root, payload carried):
#
#   run(command="bash tools/gpu_vllm/run_v2_tree.sh", carry=[".gpu-vllm-0.33.0"])
#
# Stage 1: eager V2 (enforce_eager), no speculation + dflash_tfm weaver B=7: greedy equal
#          to no speculation up to bf16 ties, a sampled run (T=1, seeded) completes, every
#          tree kernel launched.
# Stage 2: V2 with FULL_DECODE_ONLY graphs, no speculation + weaver B=7 + ddtree B=7: the
#          same checks, plus tree steps replayed FULL graphs (captured with the tree step:
#          the Triton tree kernels launched during capture are inside them).
# Each stage writes $OUT/<stage>/gpu_e2e.{md,json} and $OUT/<stage>.log; a summary is printed
# last. About 4-5 minutes on a fresh machine (setup ~30 s, each engine ~30-60 s).
set -u
OUT=${OUT:-/tmp/v2_tree_out}
mkdir -p "$OUT"
PAYLOAD=${PAYLOAD:-.gpu-vllm-0.33.0}
bash "$PAYLOAD/setup.sh" > "$OUT/setup.log" 2>&1 || { echo "setup failed"; tail -20 "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/vsrc:/tmp/site:$PWD
unset TRITON_INTERPRET
MODELS=/tmp/v2_tree_models
python3 tools/gpu_e2e.py build "$MODELS" > "$OUT/build.log" 2>&1 || { echo "model build failed"; tail -20 "$OUT/build.log"; exit 1; }

status=0
stage() {  # name, timeout seconds, gpu_e2e.py run arguments...
  local name=$1 limit=$2; shift 2
  mkdir -p "$OUT/$name"
  timeout "$limit" python3 tools/gpu_e2e.py run --models "$MODELS" --out "$OUT/$name" \
      --runner v2 --max-tokens 32 "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== stage $name: exit $rc"
  [ $rc -eq 0 ] || { status=1; grep -E "Error|error|Traceback" "$OUT/$name.log" | tail -8; }
}
stage 1-eager 200 --cudagraphs off --configs "weaver B=7" --deadline-s 150
stage 2-full-graphs 280 --cudagraphs full-decode --configs "weaver B=7" "ddtree B=7" --deadline-s 200

echo; echo "== summary"
for name in 1-eager 2-full-graphs; do
  echo "-- $name"
  if [ -f "$OUT/$name/gpu_e2e.md" ]; then grep "^|" "$OUT/$name/gpu_e2e.md"; else tail -30 "$OUT/$name.log"; fi
done
exit $status
