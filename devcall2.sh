#!/bin/bash
# device call 2 (lead, not committed)
S=$SECONDS
bash .gpu-vllm/setup.sh
mkdir -p ~/.triton/cache && tar -xzf .gpu-vllm-speed/triton_27b.tgz -C ~/.triton/cache
export PYTHONPATH=/tmp/vsrc:/tmp/site:$PWD
mkdir -p $OUT/e2e $OUT/speed
echo "== tiny e2e full-decode $((SECONDS-S)) s"
python3 tools/gpu_e2e.py build /tmp/m > /dev/null 2>&1
timeout 210 python3 tools/gpu_e2e.py run --models /tmp/m --out $OUT/e2e --max-tokens 32 \
  --cudagraphs full-decode --deadline-s 190 --configs "weaver B=64" "ddtree B=33" > $OUT/e2e/log.txt 2>&1; echo "rc $?"
grep -E "^\|" $OUT/e2e/gpu_e2e.md 2>/dev/null | cut -c1-400 || tail -20 $OUT/e2e/log.txt
echo "== speed $((SECONDS-S)) s"
timeout 170 python3 tools/bench_speed.py --out $OUT/speed --work /tmp/speed --methods dflash_tfm \
  --trees weaver --contexts 1024 --batches 1 --budgets 64 --steps 10 --profile --deadline-s 140 \
  > $OUT/speed/log.txt 2>&1; echo "rc $?"
grep -E "engine up in|period|Error" $OUT/speed/log.txt | cut -c1-300 | tail -8
grep -A2 "torch profiler" $OUT/speed/profile_*.txt | head -3
echo "done $((SECONDS-S)) s"
