"""The speed proof: engine-step times at Qwen3.6-27B shapes inside vLLM, split into
drafting / target forward / verify + commit / rest, for plain decoding, vLLM's `dflash`
chain (15) and dflash_tfm (Weaver / DDTree / chain at each budget, and its batch-size-aware
rule); projected tokens/s from them and a stated tau; requests that fit a fixed KV / state
budget. The logic, and what each number means: vllm_tfm/benchmarks/speed.py.

On the H200 (device call carrying [".gpu-vllm"], the tools/gpu_vllm payload):

    bash .gpu-vllm/setup.sh && PYTHONPATH=/tmp/vsrc:/tmp/site:$PWD \
        python3 tools/bench_speed.py --out $OUT --work /tmp/speed [--runner v1|v2]

CPU smoke mode (the tiny family, eager, tiny grid; numbers mean nothing):

    python tools/bench_speed.py --smoke --out /tmp/bench_speed

--contexts / --batches / --budgets / --trees / --methods / --steps narrow the grid;
--deadline-s stops starting measurements after that many seconds (what finished is kept:
OUT/bench_speed.md and OUT/bench_speed.json are rewritten after every engine).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from vllm_tfm.benchmarks.speed import PLAIN, SHAPES, TFM, VLLM_DFLASH, merge_reports, run
from vllm_tfm.options import TREE_KINDS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_speed_models"),
                        help="where the Qwen3.6-27B-shaped configs and Weaver are written")
    parser.add_argument("--smoke", action="store_true", help="tiny family on CPU, eager")
    parser.add_argument("--runner", choices=("v1", "v2"), default="v1",
                        help="vLLM model runner (VLLM_USE_V2_MODEL_RUNNER)")
    parser.add_argument("--methods", nargs="+", default=[PLAIN, VLLM_DFLASH, TFM],
                        choices=[PLAIN, VLLM_DFLASH, TFM])
    parser.add_argument("--trees", nargs="+", default=list(TREE_KINDS), choices=TREE_KINDS)
    parser.add_argument("--contexts", nargs="+", type=int)
    parser.add_argument("--batches", nargs="+", type=int)
    parser.add_argument("--long-batches", nargs="+", type=int,
                        help="batches at the contexts past the shortest (default: --batches)")
    parser.add_argument("--budgets", nargs="+", type=int)
    parser.add_argument("--steps", type=int)
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--memory-gib", type=float, help="the fixed KV / state budget")
    memory.add_argument("--vllm-defaults", action="store_true",
                        help="no fixed budget: the KV sized by vLLM's memory profile at its "
                             "default gpu_memory_utilization, and vLLM's max_num_seqs, "
                             "max_num_batched_tokens and capture sizes (a user's engine)")
    parser.add_argument("--max-num-seqs", type=int,
                        help="with --vllm-defaults: the engines' max_num_seqs (vLLM's default "
                             "otherwise), the setting a user of a 27B hybrid must give")
    parser.add_argument("--temperature", type=float,
                        help="every request's temperature (default 0, greedy; above 0 each "
                             "request is seeded)")
    parser.add_argument("--compilation", choices=("none", "inductor"),
                        help="CUDA engines: mode 0 (default; every small op its own torch "
                             "kernel) or vLLM's default torch.compile (Inductor fuses norms, "
                             "activations and rotary, as a user's engine does)")
    parser.add_argument("--expand-width", type=int,
                        help="dflash_tfm's Weaver nodes expanded per call (default: the "
                             "plugin's, ceil(budget / 16)); projections keep the default's tau")
    parser.add_argument("--deadline-s", type=float, default=1e9)
    parser.add_argument("--profile", action="store_true",
                        help="also profile each engine's first cell at each batch size (host "
                             "by function, kernels) into OUT/profile_<engine>_B<batch>.txt")
    parser.add_argument("--memory-trace", action="store_true",
                        help="also record where each engine's GPU memory goes while it starts "
                             "(vLLM's memory profile, its warm-up and graph captures), by the "
                             "frames that allocated it, into OUT/memory_<engine>.txt (CUDA)")
    parser.add_argument("--rule-only", action="store_true",
                        help="dflash_tfm by its batch-size-aware rule alone (the engine a user "
                             "gets), no engine pinned to a budget")
    parser.add_argument("--tfm-sync-scheduling", action="store_true",
                        help="dflash_tfm engines turn async scheduling off (on model runner "
                             "V2 it is on by default, as for the baselines)")
    parser.add_argument("--merge", nargs="+", type=Path,
                        help="only write OUT's report from these runs' bench_speed.json "
                             "(each method from the last run that measured it)")
    args = parser.parse_args(argv)
    if args.merge:
        print(merge_reports(args.merge, args.out))
        return 0
    shapes = SHAPES["tiny" if args.smoke else "qwen3.6-27b"]
    narrowed = {name: tuple(getattr(args, name)) for name in ("contexts", "batches", "long_batches",
                                                            "budgets")
                if getattr(args, name)}
    if args.steps:
        narrowed["steps"] = args.steps
    if args.memory_gib:
        narrowed["memory_bytes"] = int(args.memory_gib * (1 << 30))
    if args.vllm_defaults:
        narrowed["memory_bytes"] = None
    if args.memory_trace and (args.smoke or not torch.cuda.is_available()):
        parser.error("--memory-trace records the CUDA allocator: it needs a CUDA GPU "
                     "(not --smoke)")
    if args.max_num_seqs is not None:
        if not args.vllm_defaults or args.max_num_seqs < 1:
            parser.error("--max-num-seqs takes a count >= 1, with --vllm-defaults only")
        narrowed["max_num_seqs"] = args.max_num_seqs
    if args.temperature is not None:
        narrowed["temperature"] = args.temperature
    if args.compilation:
        narrowed["compilation"] = args.compilation
    if args.expand_width:
        narrowed["expand_width"] = args.expand_width
    shapes = dataclasses.replace(shapes, **narrowed)
    text = run(shapes, args.runner, tuple(args.methods), tuple(args.trees), args.out,
               args.work, args.deadline_s, args.profile, args.rule_only,
               args.tfm_sync_scheduling, memory_trace=args.memory_trace)
    print(text)
    return 1 if "FAILED:" in text else 0


if __name__ == "__main__":
    sys.exit(main())
