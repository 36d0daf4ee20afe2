"""Host profile (cProfile) of dflash_tfm engine steps on a CUDA GPU: where the Python side of
a tree step goes. Tiny models of `tools/gpu_e2e.py build DIR`, one request, full decode graphs,
the budget pinned (so every tree step replays a FULL graph).

On the H200 (device call carrying [".gpu-vllm"]):

    bash .gpu-vllm/setup.sh && PYTHONPATH=/tmp/vsrc:/tmp/site:$PWD python3 tools/gpu_e2e.py \
        build /tmp/m && PYTHONPATH=/tmp/vsrc:/tmp/site:$PWD python3 tools/profile_step.py \
        --models /tmp/m --out $OUT

prints (and writes OUT/profile.txt) the profiled run's wall time and the top functions by
cumulative and by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tree", default="weaver", choices=("weaver", "ddtree", "chain"))
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_FLASHINFER_SAMPLER="0",
                      HF_HUB_OFFLINE="1", VLLM_USE_V2_MODEL_RUNNER="0")
    from vllm import LLM, SamplingParams

    from vllm_tfm.tiny.gpu_checks import CUDA_GRAPH_SETTINGS, ENGINE_KWARGS
    from vllm_tfm.vllm_glue import register

    register()  # the harness has no installed entry point
    spec = {"model": str(args.models / "dflash"), "attention_backend": "TRITON_ATTN",
            "method": "dflash_tfm", "tree": args.tree, "num_speculative_tokens": args.budget,
            "budget_by_batch": [[1 << 20, args.budget]]}
    if args.tree == "weaver":
        spec["weaver"] = str(args.models / "weaver.pth")
    llm = LLM(model=str(args.models / "target"), speculative_config=spec,
              **{**ENGINE_KWARGS, "max_num_seqs": 1, **CUDA_GRAPH_SETTINGS["full-decode"]})
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(["def f(x):"], params, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    llm.generate(["import os\n"], params, use_tqdm=False)
    plain_s = time.perf_counter() - started
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    llm.generate(["class A:\n"], params, use_tqdm=False)
    profile.disable()
    profiled_s = time.perf_counter() - started
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(70)
    stats.sort_stats("tottime").print_stats(40)
    report = (f"{args.tokens} tokens: {plain_s:.3f} s unprofiled, {profiled_s:.3f} s profiled\n"
              + text.getvalue())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.txt").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
