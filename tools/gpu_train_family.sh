#!/bin/bash
# Train a tiny family (tools/train_family.py) in ONE device call and send it back through
# $OUT. Run from the repository root with the recipe's inputs carried:
#
#   run(command="RECIPE=tiny bash tools/gpu_train_family.sh", carry=["artifacts/tiny_family"],
#       timeout_s=600)
#   run(command="RECIPE=sharp SMOKE=0 bash tools/gpu_train_family.sh",
#       carry=["artifacts/sharp_corpus"], timeout_s=600)
#
# RECIPE=tiny: the committed family's recipe (models/tiny_trained/README.md) on the stored-
#   features path: target, features, drafter and Weaver from the random tiny family built on
#   the CPU machine (`python tools/make_tiny_models.py build` writes artifacts/tiny_family;
#   its tokenizer is the committed target's). Old path on an H200 (2026-11-29): target 89 s,
#   continuations ~60 s, drafter 148 s, Weaver 56 s. This path on an H100 (2026-12-06,
#   SMOKE=1): smoke 24 s, target 72 s, features 27 s, drafter 143 s, Weaver 54 s, 345 s in all.
#   Family: artifacts/tiny_retrained.
# RECIPE=sharp: the sharp family (artifacts/sharp_corpus from tools/build_corpus.py). H200
#   (2026-12-02): smoke 92 s, target 280 s, features 44 s, drafter 111 s, Weaver ~50 s: with
#   the smoke it does not fit one call, so SMOKE=0 skips it once it has passed on that
#   software (it has: torch 2.11, transformers 5.17). H100 (2026-12-06, SMOKE=0): target
#   300 s, features 41 s, drafter 93 s, Weaver 50 s. Family: artifacts/tiny_sharp.
# The training stages are stopped at BUDGET (555 s) from the start and the manifest (seconds)
# written after them, so the call ends inside its 600 s.
#
# 1. correctness first (SMOKE=1, the default): the recipe's --smoke run on CUDA (every stage,
#    a few steps), so a CUDA-only failure costs seconds, not the training;
# 2. the recipe itself, stopped at the call's budget if it runs long (stages finished by
#    then still come back);
# 3. $OUT: the family and the run's records as one tar split in 15 MiB parts
#    (<family>.tar.part-00, -01, ...; `cat <family>.tar.part-* | tar x` in the repository
#    root gives artifacts/<family> and artifacts/<family>_work's records), the log; a table
#    of the stages' times last.
set -u -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=true PYTHONPATH=$PWD
case "${RECIPE:-}" in
  tiny) FAMILY=artifacts/tiny_retrained; INPUTS=(--base artifacts/tiny_family) ;;
  sharp) FAMILY=artifacts/tiny_sharp; INPUTS=(--recipe sharp --corpus artifacts/sharp_corpus) ;;
  *) echo "RECIPE must be tiny or sharp, got '${RECIPE:-}'"; exit 2 ;;
esac
WORK=${FAMILY}_work
START=$SECONDS
BUDGET=${BUDGET:-555}
DEVICE=${DEVICE:-cuda}   # cpu: a check of this script, not a run of the recipe
LOG=$OUT/train_family.log

python3 -c 'import torch, transformers, tokenizers; print("torch", torch.__version__,
  "transformers", transformers.__version__, "tokenizers", tokenizers.__version__,
  torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")' 2>&1 | tee "$LOG"

smoke=0
if [ "${SMOKE:-1}" != 0 ]; then
  echo "== smoke (a few steps per stage)" | tee -a "$LOG"
  timeout 180 python3 tools/train_family.py "${INPUTS[@]}" --out /tmp/family_smoke/family \
    --work /tmp/family_smoke/work --smoke --device "$DEVICE" >>"$LOG" 2>&1
  smoke=$?
  echo "smoke rc=$smoke after $((SECONDS - START)) s" | tee -a "$LOG"
fi

if [ "$smoke" -eq 0 ]; then
  echo "== recipe" | tee -a "$LOG"
  timeout $((BUDGET - (SECONDS - START))) python3 tools/train_family.py "${INPUTS[@]}" \
    --out "$FAMILY" --work "$WORK" --device "$DEVICE" \
    --stages target features dflash weaver >>"$LOG" 2>&1
  echo "recipe rc=$? after $((SECONDS - START)) s" | tee -a "$LOG"
  # The manifest (seconds) outside the budget: the 2026-12-06 sharp run's four stages ended
  # inside it and the manifest did not.
  timeout 30 python3 tools/train_family.py "${INPUTS[@]}" --out "$FAMILY" --work "$WORK" \
    --device "$DEVICE" --stages manifest >>"$LOG" 2>&1
  echo "manifest rc=$? after $((SECONDS - START)) s" | tee -a "$LOG"
fi

# The family holds its training curves (<member>.training.{json,png}); stages not reached are
# absent, which tar reports and skips.
tar cf - "$FAMILY" "$WORK"/results.json "$WORK"/features/manifest.json 2>>"$LOG" \
  | split -b 15m -d - "$OUT/$(basename "$FAMILY").tar.part-"

python3 - "$WORK/results.json" <<'PY' | tee -a "$LOG"
import json, sys
try:
    results = json.load(open(sys.argv[1]))
except OSError:
    sys.exit("no results.json: no stage finished")
print(f"{'stage':10} {'seconds':>8} {'s/step':>8}  held-out")
for stage, r in results.items():
    held = (r.get("history") or [{}])[-1]
    held = {k: v for k, v in held.items() if k != "step" and not isinstance(v, list)}
    if stage == "features":
        held = {"tokens/s": r.get("this_run", {}).get("tokens_per_s")}
    print(f"{stage:10} {r.get('seconds') or r.get('this_run', {}).get('seconds') or 0:8.1f} "
          f"{r.get('seconds_per_step') or 0:8.3f}  {held}")
PY
