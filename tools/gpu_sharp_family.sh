#!/bin/bash
# Train the sharp tiny family (tools/train_family.py --recipe sharp) in ONE device call on an
# H200 and send it back through $OUT. Run from the repository root with the corpus carried:
#
#   run(command="SMOKE=0 bash tools/gpu_sharp_family.sh", carry=["artifacts/sharp_corpus"],
#       timeout_s=600)
#
# Measured on the H200 (2026-12-02, BENCHMARKS.md "Stop 15 device calls"): smoke 92 s, target
# 280 s, features 44 s, drafter 111 s, Weaver ~50 s (1500 steps at ~33/s): with the smoke the
# recipe does not fit one call (it was stopped in the Weaver stage), so SMOKE=0 skips it once
# the smoke has passed on that software (it has: torch 2.11, transformers 5.17). On an H100
# (2026-12-06, SMOKE=0): target 300 s, features 41 s, drafter 93 s, Weaver 50 s, all inside
# the budget. The training stages are stopped at BUDGET (555 s) from the start and the
# manifest (seconds) written after them, so the call ends inside its 600 s.
#
# 1. correctness first (SMOKE=1, the default): the recipe's --smoke run on CUDA (every stage,
#    a few steps), so a CUDA-only failure costs seconds, not the training;
# 2. the recipe itself, stopped at the call's budget if it runs long (stages finished by
#    then still come back);
# 3. $OUT: the family and the run's records as one tar split in 15 MiB parts
#    (tiny_sharp.tar.part-00, -01, ...; `cat tiny_sharp.tar.part-* | tar x` in the
#    repository root gives artifacts/tiny_sharp and artifacts/sharp_work), the log;
#    a table of the stages' times last.
set -u -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=true PYTHONPATH=$PWD
CORPUS=artifacts/sharp_corpus
FAMILY=artifacts/tiny_sharp
WORK=artifacts/sharp_work
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
  timeout 180 python3 tools/train_family.py --recipe sharp --corpus "$CORPUS" \
    --out /tmp/sharp_smoke/family --work /tmp/sharp_smoke/work --smoke --device "$DEVICE" >>"$LOG" 2>&1
  smoke=$?
  echo "smoke rc=$smoke after $((SECONDS - START)) s" | tee -a "$LOG"
fi

if [ "$smoke" -eq 0 ]; then
  echo "== recipe" | tee -a "$LOG"
  timeout $((BUDGET - (SECONDS - START))) python3 tools/train_family.py --recipe sharp \
    --corpus "$CORPUS" --out "$FAMILY" --work "$WORK" --device "$DEVICE" \
    --stages target features dflash weaver >>"$LOG" 2>&1
  echo "recipe rc=$? after $((SECONDS - START)) s" | tee -a "$LOG"
  # The manifest (seconds) outside the budget: the 2026-12-06 run's four stages ended
  # inside it and the manifest did not.
  timeout 30 python3 tools/train_family.py --recipe sharp --corpus "$CORPUS" --out "$FAMILY" \
    --work "$WORK" --device "$DEVICE" --stages manifest >>"$LOG" 2>&1
  echo "manifest rc=$? after $((SECONDS - START)) s" | tee -a "$LOG"
fi

# The family holds its training curves (<member>.training.{json,png}); stages not reached are
# absent, which tar reports and skips.
tar cf - "$FAMILY" "$WORK"/results.json "$WORK"/features/manifest.json 2>>"$LOG" \
  | split -b 15m -d - "$OUT/tiny_sharp.tar.part-"

python3 - "$WORK/results.json" <<'EOF' | tee -a "$LOG"
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
EOF
