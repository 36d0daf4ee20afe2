#!/bin/bash
# device call 1 (lead, not committed): 27B speed + profile, MoE family e2e, graphs test, triton cache back
S=$SECONDS
bash .gpu-vllm/setup.sh
export PYTHONPATH=/tmp/vsrc:/tmp/site:$PWD
mkdir -p $OUT/speed $OUT/moe
echo "== speed (27B shapes, V1, FULL graphs) $((SECONDS-S)) s"
timeout 300 python3 tools/bench_speed.py --out $OUT/speed --work /tmp/speed --methods dflash_tfm \
  --trees weaver --contexts 1024 --batches 1 --budgets 64 --steps 5 --profile --deadline-s 200 \
  > $OUT/speed/log.txt 2>&1; echo "rc $?"
grep -E "engine up|period|profiled|Error|error" $OUT/speed/log.txt | tail -12
echo "== triton cache $((SECONDS-S)) s"
true
ls -la $OUT; echo "done $((SECONDS-S)) s"
