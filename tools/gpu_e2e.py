"""dflash_tfm end to end on a CUDA GPU inside vLLM 0.32's or 0.33's Python code (tools/gpu_vllm).

    python tools/gpu_e2e.py build DIR                 # models; any machine (CPU is fine)
    python tools/gpu_e2e.py run --models DIR --out OUT [--max-tokens 48] [--deadline-s 330]
                                [--cudagraphs off|full-decode|compiled-full-decode|default]
                                [--runner v1|v2]

On the lent H200 (device call carrying [".gpu-vllm", DIR], payload from
`VLLM_VERSION=0.33.0 bash tools/gpu_vllm/build_payload.sh .gpu-vllm`, or 0.32.0; the whole
table took ~290 s of one call on 0.32):

    bash .gpu-vllm/setup.sh && PYTHONPATH=/tmp/vsrc:/tmp/site:$PWD \
        python3 tools/gpu_e2e.py run --models DIR --out $OUT --deadline-s 240

`build` writes a tiny DENSE hybrid target (`qwen3_5_text`, Qwen3_5ForCausalLM: 8 layers,
(GDN x3 + full attention) x2, the harness runs no MoE), a DFlash drafter and a random Weaver,
with the tiny family's initialisation (vllm_tfm/tiny/gpu_models.py).

`--models models/tiny_trained` runs the trained family instead (Qwen3-Next target with its
one-expert MoE layer, through the harness's pure-torch `_moe_C` stand-in; its Weaver is the
`weaver/` safetensors directory).

`run` generates for a batch of prompts with no speculation, vLLM's own `dflash` and
`dflash_tfm` (trees weaver / ddtree / chain, budgets 7 / 33 / 64), greedy (the prompts in
one batch, then each alone: batch 1) and sampled (T=1, seeded), one engine per configuration
in this process, and

- compares each greedy output with no speculation: a difference is accepted only where the
  no-speculation run's top-2 logprob margin is below `engine_runs.TIE_MARGIN` (bf16 ties);
- counts launches of the project's Triton kernels (every `JITFunction.run` of a kernel
  defined under `triton_ops`) per configuration and requires each kernel of the tree path
  to have run;
- prints one table (tokens/s and mean accepted length per configuration, from vLLM's
  spec-decode counters) and one of the batch-1 decode steps split into drafting / target
  forward / verify + commit / rest (vllm_tfm/benchmarks/step_phases.py), and writes
  OUT/gpu_e2e.md and OUT/gpu_e2e.json after every configuration (a time-out keeps what
  finished).

`--cudagraphs` picks the compilation settings (`CUDA_GRAPH_SETTINGS`); the report counts the
target forwards of each engine by the CUDA-graph mode vLLM dispatched, for steps with trees
and the others, and fails a configuration whose tree steps replayed a graph.

`--profile` also profiles each configuration's greedy run of the first prompt alone:
cProfile (the host by function), then torch's profiler (kernels by the phase that launched
them, device time against wall time), into OUT/profile_<config>.txt.

`--staggered` admits the prompts 4 at a time with different output lengths, so requests
finish at different steps and new prompts are prefilled beside running trees: it requires
the GDN layers' mixed path (prompt rows through vLLM's kernels, tree rows through ours) to
have run. `--configs` keeps the configurations whose label contains one of its words.
`--runner v2` runs every configuration on model runner V2 (vLLM 0.33's GPU default),
dflash_tfm through vllm_glue/v2 (tools/gpu_vllm/run_v2_tree.sh stages it).

Exit status 1 when a check failed. Configurations are run in priority order and those that
would start after `--deadline-s` are listed as skipped. The check itself is
vllm_tfm/tiny/gpu_checks.py (engine runs, report) and launch_counts.py (counters); with the
repository root on PYTHONPATH (as above) the package needs no install.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_tfm.tiny.gpu_checks import (
    CUDA_GRAPH_SETTINGS,
    ENGINE_KWARGS,
    RUNNERS,
    run_all,
    set_harness_env,
)
from vllm_tfm.tiny.gpu_models import build_models


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="write the target, drafter and Weaver")
    build.add_argument("dir", type=Path)
    run = sub.add_parser("run", help="run every configuration (CUDA, in the harness)")
    run.add_argument("--models", type=Path, required=True)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--max-tokens", type=int, default=48)
    run.add_argument("--deadline-s", type=float, default=330.0,
                     help="start no configuration after this many seconds")
    run.add_argument("--staggered", action="store_true",
                     help="4 requests at a time, different lengths (mixed prompt + tree batches)")
    run.add_argument("--configs", nargs="+", default=None,
                     help="keep configurations whose label contains one of these words "
                          "(no speculation always runs: it is the reference)")
    run.add_argument("--cudagraphs", choices=sorted(CUDA_GRAPH_SETTINGS), default="off",
                     help="off: enforce_eager; full-decode: mode 0 + FULL_DECODE_ONLY; "
                          "compiled-full-decode: torch.compile + FULL_DECODE_ONLY; "
                          "default: vLLM's default compilation and graphs")
    run.add_argument("--runner", choices=RUNNERS, default="v1",
                     help="the model runner every configuration runs on (v2: dflash_tfm "
                          "through vllm_glue/v2)")
    run.add_argument("--tfm-sync-scheduling", action="store_true",
                     help="dflash_tfm engines turn async scheduling off (on model runner "
                          "V2 it is on by default, as for the baselines)")
    run.add_argument("--max-model-len", type=int, default=ENGINE_KWARGS["max_model_len"],
                     help="every engine's max_model_len (below prompt + max tokens: requests "
                          "end there, their last steps with fewer drafts, then none)")
    run.add_argument("--profile", action="store_true",
                     help="also profile each configuration's greedy run of the first prompt "
                          "alone (host by function, kernels by phase) into "
                          "OUT/profile_<config>.txt")
    args = parser.parse_args(argv)
    if args.command == "build":
        build_models(args.dir)
        print(f"models in {args.dir}")
        return 0
    set_harness_env()
    args.out.mkdir(parents=True, exist_ok=True)
    return run_all(args.models, args.out, args.max_tokens, args.deadline_s, args.staggered,
                   args.configs, args.cudagraphs, args.runner, args.tfm_sync_scheduling,
                   args.max_model_len, args.profile)


if __name__ == "__main__":
    sys.exit(main())
