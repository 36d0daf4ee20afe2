#!/bin/bash
# dflash_tfm on model runner V2 (vLLM 0.33.0) on the H200, staged: a stage that fails still
# leaves the earlier stages' reports. Device call (repository root, payload carried):
#
#   run(command="bash tools/gpu_vllm/run_v2_tree.sh [STAGE...]", carry=[".gpu-vllm-0.33.0"])
#
# STAGE: 1-eager, 2-full-graphs, 3-sampling, 4-default, 5-budget-by-batch, 6-sync,
# 7-length-limit (default: the first five, longer than one call should be: stage 3 alone is
# ~3-4 minutes, stages 1 + 2 ~4-5, stage 4 ~3, stage 5 ~3-4, stage 6 ~3, stage 7 ~2).
#
# Stage 1: eager V2 (enforce_eager), no speculation + dflash_tfm weaver B=7: greedy equal
#          to no speculation up to bf16 ties, a sampled run (T=1, seeded) completes, every
#          tree kernel launched.
# Stage 2: V2 with FULL_DECODE_ONLY graphs, no speculation + weaver B=7 + ddtree B=7: the
#          same checks, plus tree steps replayed FULL graphs (captured with the tree step:
#          the Triton tree kernels launched during capture are inside them).
# Stage 3: V2 with FULL_DECODE_ONLY graphs, no speculation vs weaver B=7, processed logprobs
#          (tools/gpu_v2_sampling.py): greedy and greedy + repetition / presence / frequency
#          penalties equal up to bf16 ties with logprobs within 3e-2, prompt logprobs within
#          3e-2, a sampled top_k 20 / top_p 0.95 / min_tokens run complete inside its processed
#          support and repeated with the same tokens (seeded), sampled trees drafted and
#          verified by traversal (T >= 0.75), the T=1 law of 1000 samples equal to no
#          speculation's (chi-square z < 4), min_p refused by vLLM, tree steps replaying
#          FULL graphs.
# Stage 4: what a user gets with no settings once V2 is dflash_tfm's default: vLLM's default
#          compilation and graphs (torch.compile, FULL + PIECEWISE), weaver B=7, staggered
#          requests (prompt chunks beside trees): greedy vs no speculation, tree steps never
#          in a PIECEWISE graph (tools/gpu_e2e.py --cudagraphs default --staggered).
# Stage 5: the batch-size-aware budget through vLLM's dynamic speculative decoding
#          (tools/gpu_vllm/v2_dynsd_check.py says what it checks): FULL graphs replayed at
#          every query length 1 + k of the schedule, greedy vs no speculation.
# Stage 6: stage 2's weaver check with dflash_tfm turning async scheduling off (on V2 it is
#          on by default, so stages 1-5 run with it; vllm_glue/config.py): greedy equal to no
#          speculation up to bf16 ties, the sampled run complete, tree steps replaying FULL
#          graphs.
# Stage 7: stage 2's weaver check with max_model_len 40 (prompts of 9-17 tokens, 64 tokens
#          asked): every request ends at max_model_len, vLLM cuts its drafts as it nears it
#          and schedules its last step with none; the last request runs those steps alone,
#          batches of decodes without drafts that V2 still runs as GDN spec rows (one-node
#          tree steps: "V2 steps of decodes without drafts", counted). Greedy equal to no
#          speculation at the same max_model_len up to bf16 ties.
# Each stage writes $OUT/<stage>/ (gpu_e2e.{md,json} or v2_sampling.{md,json}) and
# $OUT/<stage>.log; $OUT/cache_*.tar.xz hold what this machine compiled (merge them into the
# payload: device_caches.sh); a summary is printed last. Setup ~30 s, each engine ~30-60 s.
set -u
OUT=${OUT:-/tmp/v2_tree_out}
mkdir -p "$OUT"
PAYLOAD=${PAYLOAD:-.gpu-vllm-0.33.0}
bash "$PAYLOAD/setup.sh" > "$OUT/setup.log" 2>&1 || { echo "setup failed"; tail -20 "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/vsrc:/tmp/site:$PWD
unset TRITON_INTERPRET
MODELS=/tmp/v2_tree_models
python3 tools/gpu_e2e.py build "$MODELS" > "$OUT/build.log" 2>&1 || { echo "model build failed"; tail -20 "$OUT/build.log"; exit 1; }

STAGES=${*:-1-eager 2-full-graphs 3-sampling 4-default 5-budget-by-batch}
status=0
stage() {  # name, timeout seconds, then "e2e" and gpu_e2e.py run arguments, or a command
  local name=$1 limit=$2; shift 2
  case " $STAGES " in *" $name "*) ;; *) return ;; esac
  mkdir -p "$OUT/$name"
  local command=("$@")
  if [ "$1" = e2e ]; then
    command=(python3 tools/gpu_e2e.py run --models "$MODELS" --out "$OUT/$name" --runner v2
             --max-tokens 32 "${@:2}")
  fi
  timeout "$limit" "${command[@]}" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== stage $name: exit $rc"
  [ $rc -eq 0 ] || { status=1; grep -E "Error|error|Traceback" "$OUT/$name.log" | tail -8; }
}
stage 1-eager 200 e2e --cudagraphs off --configs "weaver B=7" --deadline-s 150
stage 2-full-graphs 280 e2e --cudagraphs full-decode --configs "weaver B=7" \
    "ddtree B=7" --deadline-s 200
stage 3-sampling 360 python3 tools/gpu_v2_sampling.py --models "$MODELS" \
    --out "$OUT/3-sampling" --max-tokens 32
stage 4-default 280 e2e --cudagraphs default --configs "weaver B=7" --staggered --deadline-s 200
stage 5-budget-by-batch 420 python3 tools/gpu_vllm/v2_dynsd_check.py --models "$MODELS" \
    --out "$OUT/5-budget-by-batch" --max-tokens 32
stage 6-sync 280 e2e --cudagraphs full-decode --configs "weaver B=7" --tfm-sync-scheduling \
    --deadline-s 200
stage 7-length-limit 280 e2e --cudagraphs full-decode --configs "weaver B=7" \
    --max-model-len 40 --max-tokens 64 --deadline-s 200

bash tools/gpu_vllm/device_caches.sh save "$OUT/cache"   # merge them here: device_caches.sh
echo; echo "== summary"
for name in $STAGES; do
  echo "-- $name"
  report=$(ls "$OUT/$name"/*.md 2>/dev/null | head -1)
  if [ -n "$report" ]; then grep "^|" "$report"; else tail -30 "$OUT/$name.log"; fi
done
exit $status
