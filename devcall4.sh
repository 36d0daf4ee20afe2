#!/bin/bash
# device call 4 (lead, not committed): V2 tree stages; then V1 FULL-graph commit check; then GDN kernels if time remains
S=$SECONDS
bash tools/gpu_vllm/run_v2_tree.sh
left() { echo $((560 - (SECONDS - S))); }
if [ "$(left)" -gt 150 ]; then
  echo "== V1 full-decode e2e (commit graphs) at $((SECONDS-S)) s"
  mkdir -p $OUT/v1
  ( export PYTHONPATH=/tmp/vsrc:/tmp/site:$PWD
    timeout $(( $(left) - 20 )) python3 tools/gpu_e2e.py run --models /tmp/v2_tree_models --out $OUT/v1 --max-tokens 32 \
      --cudagraphs full-decode --deadline-s $(( $(left) - 60 )) --configs "weaver B=64" > $OUT/v1.log 2>&1; echo "rc $?" )
  grep "^|" $OUT/v1/gpu_e2e.md 2>/dev/null | cut -c1-500 || tail -15 $OUT/v1.log
  grep -iE "commit.*failed|Traceback" $OUT/v1.log | head -5
fi
if [ "$(left)" -gt 90 ]; then
  echo "== GDN quick at $((SECONDS-S)) s"
  ( export PYTHONPATH=$PWD/.gpu-fla:$PWD
    timeout $(( $(left) - 10 )) python3 tools/bench_kernels.py --only gdn --gdn-sections timing --kernels tile,split,staged --gdn-shapes 64x1,128x1,64x32,16x1 --budget-s $(( $(left) - 40 )) --out $OUT/gdn.txt > $OUT/gdn.log 2>&1 )
  tail -c 3000 $OUT/gdn.log
fi
echo "done $((SECONDS-S)) s"
