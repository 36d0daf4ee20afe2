#!/bin/bash
bash .gpu-vllm-0.33.0/setup.sh > /dev/null 2>&1
export PYTHONPATH=/tmp/vsrc:/tmp/site:$PWD
[ -d /tmp/v2_tree_models ] || python3 tools/gpu_e2e.py build /tmp/v2_tree_models > /dev/null 2>&1
mkdir -p $OUT/v2
timeout 125 python3 tools/gpu_e2e.py run --models /tmp/v2_tree_models --out $OUT/v2 --runner v2 --max-tokens 32 \
  --cudagraphs full-decode --configs "weaver B=7" --deadline-s 110 > $OUT/v2.log 2>&1; echo "rc $?"
grep "^|" $OUT/v2/gpu_e2e.md | cut -c1-500; grep -E "Error|Traceback" $OUT/v2.log | tail -6
