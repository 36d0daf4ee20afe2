#!/bin/bash
# device call 3 (lead, not committed): commit-graph e2e check (0.32 harness, V1 FULL graphs), GDN kernels table
S=$SECONDS
bash .gpu-vllm/setup.sh > /dev/null
mkdir -p $OUT/e2e
echo "== tiny e2e full-decode $((SECONDS-S)) s"
( export PYTHONPATH=/tmp/vsrc:/tmp/site:$PWD
  python3 tools/gpu_e2e.py build /tmp/m > /dev/null 2>&1
  timeout 210 python3 tools/gpu_e2e.py run --models /tmp/m --out $OUT/e2e --max-tokens 32 \
    --cudagraphs full-decode --deadline-s 190 --configs "weaver B=64" "ddtree B=33" > $OUT/e2e/log.txt 2>&1; echo "rc $?" )
grep -E "^\|" $OUT/e2e/gpu_e2e.md 2>/dev/null | cut -c1-600 || tail -20 $OUT/e2e/log.txt
grep -iE "commit.*failed|Traceback" $OUT/e2e/log.txt | head -5
echo "== GDN kernels $((SECONDS-S)) s"
( export PYTHONPATH=$PWD/.gpu-fla:$PWD
  timeout 250 python3 tools/bench_kernels.py --only gdn --gdn-sections timing,correctness,sweep --sweep --sweep-kernel staged --kernels tile,split,staged --gdn-shapes 64x1,128x1,64x32,128x8,64x8,16x1,32x1,128x32,32x8,16x32,32x32,16x8 --budget-s 170 --out $OUT/gdn.txt > $OUT/bench.log 2>&1; echo "rc $?" )
tail -c 6000 $OUT/bench.log
echo "done $((SECONDS-S)) s"
