"""dflash_tfm end to end on a CUDA GPU inside vLLM 0.32 (shared/gpu-vllm harness).

    python tools/gpu_e2e.py build DIR                 # models; any machine (CPU is fine)
    python tools/gpu_e2e.py run --models DIR --out OUT [--max-tokens 48] [--deadline-s 330]
                                [--cudagraphs off|full-decode|default]

On the lent H200 (device call carrying [".gpu-vllm", DIR], payload from
shared/gpu-vllm/build_payload.sh; the whole table took ~290 s of one call):

    bash .gpu-vllm/setup.sh && PYTHONPATH=/tmp/vsrc:/tmp/site:$PWD \
        python3 tools/gpu_e2e.py run --models DIR --out $OUT --deadline-s 240

`build` writes a tiny DENSE hybrid target (`qwen3_5_text`, Qwen3_5ForCausalLM: 8 layers,
(GDN x3 + full attention) x2, the harness runs no MoE), a DFlash drafter and a random Weaver,
with the tiny family's initialisation (tools/tiny_family.py).

`run` generates for a batch of prompts with no speculation, vLLM's own `dflash` and
`dflash_tfm` (trees weaver / ddtree / chain, budgets 7 / 33 / 64), greedy and sampled
(T=1, seeded), one engine per configuration in this process, and

- compares each greedy output with no speculation: a difference is accepted only where the
  no-speculation run's top-2 logprob margin is below `tiny_family.TIE_MARGIN` (bf16 ties);
- counts launches of the project's Triton kernels (every `JITFunction.run` of a kernel
  defined under `triton_ops`) per configuration and requires each kernel of the tree path
  to have run;
- prints one table (tokens/s and mean accepted length per configuration, from vLLM's
  spec-decode counters) and writes OUT/gpu_e2e.md and OUT/gpu_e2e.json after every
  configuration (a time-out keeps what finished).

`--cudagraphs` picks the compilation settings (`CUDA_GRAPH_SETTINGS`); the report counts the
target forwards of each engine by the CUDA-graph mode vLLM dispatched, for steps with trees
and the others, and fails a configuration whose tree steps replayed a graph.

`--staggered` admits the prompts 4 at a time with different output lengths, so requests
finish at different steps and new prompts are prefilled beside running trees: it requires
the GDN layers' mixed path (prompt rows through vLLM's kernels, tree rows through ours) to
have run. `--configs` keeps the configurations whose label contains one of its words.

Exit status 1 when a check failed. Configurations are run in priority order and those that
would start after `--deadline-s` are listed as skipped.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tools"))

import tiny_family  # noqa: E402

NUM_LAYERS = 8
TARGET_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": tiny_family.VOCAB_SIZE,
    "hidden_size": tiny_family.HIDDEN,
    "intermediate_size": 512,
    "num_hidden_layers": NUM_LAYERS,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * (NUM_LAYERS // 4),
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25},
    # GDN shapes of shared/gpu-vllm/make_tiny.py: its carried Triton cache then holds
    # vLLM's GDN prefill kernels for them.
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "eos_token_id": tiny_family.EOS_ID,
    "pad_token_id": tiny_family.PAD_ID,
    "dtype": "bfloat16",
}

# The tree path's kernels (module.function of each Triton kernel) and when they must run.
TREE_KERNELS = {
    "triton_ops.tree_conv.conv._tree_conv1d_kernel": "tree conv",
    "triton_ops.tree_conv.conv._tree_conv1d_commit_kernel": "tree conv commit",
    "triton_ops.gdn_tree.chunk_triton._commit_kernel": "gdn_tree_commit",
    "triton_ops.tree_attention.attention._tree_attention_split_kernel": "tree attention",
    "triton_ops.tree_attention.attention._tree_attention_merge_kernel": "tree attention merge",
    "triton_ops.tree_attention.kv_commit._tree_kv_commit_kernel": "tree_kv_commit",
}
GDN_VERIFY_KERNELS = (  # one of them, by tree size
    "triton_ops.gdn_tree.chunk_triton._verify_tile_kernel",
    "triton_ops.gdn_tree.chunk_triton._verify_rowblock_kernel",
)
WEAVER_KERNELS = {"triton_ops.pool_logits.pool_logits._pool_logits_kernel": "pool logits"}

HARNESS_LIMITS = (
    "Harness limits: vLLM 0.32's Python code on torch 2.11 without its compiled ops "
    "(shared/gpu-vllm): CUDA graphs as --cudagraphs sets them, TRITON_ATTN, Triton GDN, "
    "norms/RoPE/SiLU in pure torch, model runner V1, tiny random models (hidden 256, 8 layers, "
    "random drafter and Weaver: acceptance is low). Timings are functional, not performance."
)


# ---------------------------------------------------------------------------------------------
# Models


def build_target(out_dir: Path) -> None:
    """The dense qwen3_5_text target, weights by the tiny family's rules, bf16 safetensors."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    kwargs = {k: v for k, v in TARGET_CONFIG.items() if k not in ("architectures", "model_type")}
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**kwargs))
    state = {
        name: tiny_family._init_value(name, tuple(tensor.shape), zero_centered_norms=True)
        .to(torch.bfloat16).contiguous()
        for name, tensor in model.state_dict().items()
    }
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(TARGET_CONFIG, indent=2) + "\n")
    tiny_family.build_tokenizer(out_dir)


def build_models(root: Path) -> None:
    for name in ("target", "dflash"):
        (root / name).mkdir(parents=True, exist_ok=True)
    build_target(root / "target")
    tiny_family.build_dflash(root / "dflash")
    tiny_family.build_weaver(root / "weaver.pth")


# ---------------------------------------------------------------------------------------------
# Triton launch counter


LAUNCHES: collections.Counter = collections.Counter()
MIXED_GDN = "GDN calls with prompt and tree rows"


def count_project_kernel_launches() -> None:
    """Count every launch of a Triton kernel defined under ``triton_ops`` (by module.name)."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def run(self, *args, **kwargs):
        if not kwargs.get("warmup", False):
            module = getattr(self.fn, "__module__", "") or ""
            if module.startswith("triton_ops."):
                LAUNCHES[f"{module}.{self.fn.__name__}"] += 1
        return original(self, *args, **kwargs)

    JITFunction.run = run


def count_mixed_gdn_calls() -> None:
    """Count GDN layer calls that split a batch into prompt rows and tree rows."""
    from vllm_tfm.vllm_glue import cuda_gdn

    original = cuda_gdn._forward_prompt_rows

    def forward_prompt_rows(*args, **kwargs):
        LAUNCHES[MIXED_GDN] += 1
        return original(*args, **kwargs)

    cuda_gdn._forward_prompt_rows = forward_prompt_rows


def count_graph_dispatch() -> None:
    """Count target forwards by CUDA-graph mode, split into steps with and without trees."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._determine_batch_execution_and_padding

    def determine(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if "force_uniform_decode" in kwargs:  # a dummy run (capture, profiling)
            return result
        step = getattr(self, "_tfm_step", None)
        kind = "tree" if step is not None and step.has_trees else "other"
        LAUNCHES[f"{kind} steps, graph mode {result[0].name}"] += 1
        return result

    GPUModelRunner._determine_batch_execution_and_padding = determine


def graph_summary(launches: dict) -> str:
    return ", ".join(f"{name} {count}" for name, count in sorted(launches.items())
                     if " steps, graph mode " in name) or "-"


def missing_kernels(launches: dict, tree: str, staggered: bool) -> list[str]:
    required = dict(TREE_KERNELS)
    if staggered:
        required[MIXED_GDN] = "mixed prompt + tree GDN batches"
    if tree == "weaver":
        required.update(WEAVER_KERNELS)
    missing = [label for name, label in required.items() if launches.get(name, 0) == 0]
    if not any(launches.get(name, 0) for name in GDN_VERIFY_KERNELS):
        missing.append("gdn_tree_verify")
    return missing


# ---------------------------------------------------------------------------------------------
# Engine runs


ENGINE_KWARGS = dict(
    enforce_eager=True, dtype="bfloat16", seed=0, max_model_len=1024, max_num_seqs=8,
    enable_prefix_caching=False, gpu_memory_utilization=0.1, kv_cache_memory_bytes=1 << 30,
    compilation_config={"custom_ops": ["none"]}, attention_config={"backend": "TRITON_ATTN"},
    additional_config={"gdn_prefill_backend": "triton"}, disable_log_stats=False,
)


# Compilation settings by --cudagraphs. "default" is vLLM's own (torch.compile, FULL and
# PIECEWISE graphs), minus the harness's need for pure-torch custom ops; "full-decode" is
# the cheapest graphed setting the harness runs (no torch.compile, full decode graphs).
CUDA_GRAPH_SETTINGS = {
    "off": {},
    "full-decode": dict(enforce_eager=False, compilation_config={
        "mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "custom_ops": ["none"]}),
    "default": dict(enforce_eager=False, compilation_config={"custom_ops": ["none"]}),
}


def configurations(models: Path) -> list[tuple[str, str | None, dict | None]]:
    """(label, tree kind or None, speculative_config) in priority order."""
    dflash = {"model": str(models / "dflash"), "attention_backend": "TRITON_ATTN"}

    def tfm(tree: str, budget: int) -> tuple[str, str, dict]:
        config = {**dflash, "method": "dflash_tfm", "tree": tree, "num_speculative_tokens": budget}
        if tree == "weaver":
            config["weaver"] = str(models / "weaver.pth")
        return f"dflash_tfm {tree} B={budget}", tree, config

    return [
        ("no speculation", None, None),
        tfm("chain", 7),
        tfm("ddtree", 33),
        tfm("weaver", 64),
        ("vLLM dflash (chain, 15)", None,
         {**dflash, "method": "dflash", "num_speculative_tokens": 15}),
        tfm("weaver", 7),
        tfm("weaver", 33),
        tfm("ddtree", 7),
        tfm("ddtree", 64),
        tfm("chain", 33),
        tfm("chain", 64),
    ]


def _spec_counters(llm) -> tuple[int, int]:
    values = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return (int(values.get("vllm:spec_decode_num_drafts", 0)),
            int(values.get("vllm:spec_decode_num_accepted_tokens", 0)))


def _timed(llm, prompts, params) -> dict:
    before = _spec_counters(llm)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    drafts, accepted = (a - b for a, b in zip(_spec_counters(llm), before))
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    result = {"tokens": tokens, "seconds": seconds,
              "tokens_per_s": sum(map(len, tokens)) / seconds,
              "drafts": drafts, "accepted": accepted,
              "tau": 1 + accepted / drafts if drafts else None}
    if outputs and outputs[0].outputs[0].logprobs:
        result["margins"] = [tiny_family.top2_margins(o.outputs[0].logprobs) for o in outputs]
    return result


def run_config(models: Path, speculative_config: dict | None, prompts: list[str],
               max_tokens: list[int], with_margins: bool, max_num_seqs: int,
               cudagraphs: str = "off") -> dict:
    """Warm-up, then timed greedy (and with logprobs when ``with_margins``) and sampled
    runs; ``max_tokens[i]`` new tokens for prompt ``i``."""
    import torch
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=str(models / "target"), speculative_config=speculative_config,
              **{**ENGINE_KWARGS, "max_num_seqs": max_num_seqs,
                 **CUDA_GRAPH_SETTINGS[cudagraphs]})
    result: dict = {"start_s": time.perf_counter() - started}
    try:
        warm = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        result["warmup_s"] = time.perf_counter() - warm
        greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for n in max_tokens]
        result["greedy"] = _timed(llm, prompts, greedy)
        if with_margins:
            logprobs = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                       logprobs=2) for n in max_tokens]
            result["greedy_logprobs"] = _timed(llm, prompts, logprobs)
        sampled = [SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=n,
                                  ignore_eos=True) for i, n in enumerate(max_tokens)]
        result["sampled"] = _timed(llm, prompts, sampled)
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return result


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


def write_report(rows: list[dict], out: Path, header: str) -> str:
    lines = [
        header, "",
        "| configuration | greedy tok/s | greedy tau | sampled tok/s | sampled tau "
        "| greedy vs no-spec | tree kernels | target forwards by graph mode |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['config']} | FAILED: {row['error'][:120]} | | | | | | |")
            continue
        if "skipped" in row:
            lines.append(f"| {row['config']} | skipped ({row['skipped']}) | | | | | | |")
            continue
        g, s = row["greedy"], row["sampled"]
        lines.append(
            f"| {row['config']} | {g['tokens_per_s']:.1f} | {_fmt(g['tau'], '.2f')} "
            f"| {s['tokens_per_s']:.1f} | {_fmt(s['tau'], '.2f')} | {row.get('equality', '-')} "
            f"| {row.get('kernels', '-')} | {graph_summary(row.get('launches', {}))} |"
        )
    lines += ["", HARNESS_LIMITS]
    text = "\n".join(lines) + "\n"
    (out / "gpu_e2e.md").write_text(text)
    (out / "gpu_e2e.json").write_text(json.dumps(rows, indent=1))
    return text


def _equality(base: dict, spec: dict) -> tuple[str, bool]:
    """'matched/total' greedy tokens and whether every difference is a bf16 tie."""
    rows = tiny_family.compare_greedy(
        {"tokens": base["tokens"], "margins": base["margins"]}, {"tokens": spec["tokens"]}
    )
    matched = sum(r["matched"] for r in rows)
    total = sum(r["length"] for r in rows)
    diffs = [r for r in rows if r["matched"] < r["length"]]
    ok = all(r["tie"] for r in diffs)
    text = f"{len(rows) - len(diffs)}/{len(rows)} prompts equal"
    if diffs:
        margins = ", ".join(_fmt(r["margin"], ".2f") for r in diffs)
        text += f"; first-diff margins {margins} ({'ties' if ok else 'NOT ties'})"
    return f"{text} [{matched}/{total} tok]", ok


def run_all(models: Path, out: Path, max_tokens: int, deadline_s: float, staggered: bool,
            config_words: list[str] | None, cudagraphs: str = "off") -> int:
    import torch
    import triton

    import vllm
    from vllm_tfm.vllm_glue import register

    register()  # the plugin's entry point is not installed in the harness: register here
    count_project_kernel_launches()
    count_mixed_gdn_calls()
    count_graph_dispatch()
    prompts = list(tiny_family.PROMPTS)
    if staggered:
        # 4 running at a time, lengths max_tokens, max_tokens - 5, ...: requests
        # finish at different steps and the next prompt joins a batch of trees.
        max_num_seqs = 4
        lengths = [max(8, max_tokens - 5 * i) for i in range(len(prompts))]
        batching = (f"{len(prompts)} prompts, at most {max_num_seqs} running, "
                    f"{min(lengths)}..{max(lengths)} new tokens each")
    else:
        max_num_seqs = len(prompts)
        lengths = [max_tokens] * len(prompts)
        batching = f"{len(prompts)} prompts in one batch, {max_tokens} new tokens each"
    header = (f"dflash_tfm end to end on {torch.cuda.get_device_name(0)}: vLLM {vllm.__version__}, "
              f"torch {torch.__version__}, triton {triton.__version__}; {batching}; "
              f"tau = mean accepted length incl. bonus (vLLM spec-decode counters); "
              f"CUDA graphs {cudagraphs}: {CUDA_GRAPH_SETTINGS[cudagraphs] or 'enforce_eager'}")
    print(header, flush=True)
    started = time.perf_counter()
    rows: list[dict] = []
    base = None
    failed = False
    for label, tree, config in configurations(models):
        if config_words and config is not None and not any(w in label for w in config_words):
            continue
        elapsed = time.perf_counter() - started
        if elapsed > deadline_s:
            rows.append({"config": label, "skipped": f"deadline, {elapsed:.0f} s elapsed"})
            write_report(rows, out, header)
            continue
        print(f"=== {label} (t={elapsed:.0f} s)", flush=True)
        before = collections.Counter(LAUNCHES)
        try:
            result = run_config(models, config, prompts, lengths, with_margins=config is None,
                                max_num_seqs=max_num_seqs, cudagraphs=cudagraphs)
        except Exception as error:  # one configuration's failure must not hide the others'
            traceback.print_exc()
            rows.append({"config": label, "error": f"{type(error).__name__}: {error}"})
            failed = True
            write_report(rows, out, header)
            continue
        launches = {k: v - before.get(k, 0) for k, v in LAUNCHES.items() if v - before.get(k, 0)}
        row = {"config": label, **result, "launches": launches}
        if config is None:
            base = result["greedy_logprobs"]
            if base["tokens"] != result["greedy"]["tokens"]:
                row["equality"] = "logprobs run differs from the timed run"
                failed = True
        elif base is not None:
            row["equality"], ok = _equality(base, result["greedy"])
            failed |= not ok
        if tree is not None and any(launches.get(f"tree steps, graph mode {mode}")
                                    for mode in ("FULL", "PIECEWISE")):
            row["kernels"] = "TREE STEPS REPLAYED A GRAPH"
            failed = True
        elif tree is not None:
            missing = missing_kernels(launches, tree, staggered)
            row["kernels"] = "all ran" if not missing else "MISSING " + ", ".join(missing)
            failed |= bool(missing)
        rows.append(row)
        g, s = result["greedy"], result["sampled"]
        print(f"    start {result['start_s']:.1f} s, warm-up {result['warmup_s']:.1f} s; greedy "
              f"{g['tokens_per_s']:.1f} tok/s tau {_fmt(g['tau'], '.2f')}; sampled "
              f"{s['tokens_per_s']:.1f} tok/s tau {_fmt(s['tau'], '.2f')}; "
              f"{row.get('equality', '')} {row.get('kernels', '')}", flush=True)
        print(f"    launches {launches}", flush=True)
        write_report(rows, out, header)
    print(write_report(rows, out, header), flush=True)
    return 1 if failed else 0


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
                          "default: vLLM's default compilation and graphs")
    args = parser.parse_args(argv)
    if args.command == "build":
        build_models(args.dir)
        print(f"models in {args.dir}")
        return 0
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0",
                       "VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1",
                       "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                       "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(key, value)
    args.out.mkdir(parents=True, exist_ok=True)
    return run_all(args.models, args.out, args.max_tokens, args.deadline_s, args.staggered,
                   args.configs, args.cudagraphs)


if __name__ == "__main__":
    sys.exit(main())
