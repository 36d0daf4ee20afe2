#!/bin/bash
# The batch-size-aware budget on model runner V2 (vLLM 0.33.0's dynamic speculative
# decoding) on the H200: tools/gpu_vllm/v2_dynsd_check.py (what it checks is there).
# Device call (repository root, payload carried; ~3-4 minutes: setup ~30 s, three engines):
#
#   run(command="bash tools/gpu_vllm/run_v2_dynsd.sh", carry=[".gpu-vllm-0.33.0"])
#
# Writes $OUT/v2_dynsd.{md,json}, $OUT/check.log; the table is printed last.
set -u
OUT=${OUT:-/tmp/v2_dynsd_out}
mkdir -p "$OUT"
PAYLOAD=${PAYLOAD:-.gpu-vllm-0.33.0}
bash "$PAYLOAD/setup.sh" > "$OUT/setup.log" 2>&1 || { echo "setup failed"; tail -20 "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/vsrc:/tmp/site:$PWD
unset TRITON_INTERPRET
MODELS=/tmp/v2_tree_models
python3 tools/gpu_e2e.py build "$MODELS" > "$OUT/build.log" 2>&1 || { echo "model build failed"; tail -20 "$OUT/build.log"; exit 1; }
timeout 420 python3 tools/gpu_vllm/v2_dynsd_check.py --models "$MODELS" --out "$OUT" \
    --max-tokens 32 > "$OUT/check.log" 2>&1
status=$?
echo "== v2_dynsd_check: exit $status"
[ $status -eq 0 ] || grep -E "Error|error|Traceback" "$OUT/check.log" | tail -8
if [ -f "$OUT/v2_dynsd.md" ]; then cat "$OUT/v2_dynsd.md"; else tail -30 "$OUT/check.log"; fi
exit $status
