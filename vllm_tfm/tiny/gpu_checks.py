"""The end-to-end check on a CUDA GPU (tools/gpu_e2e.py `run`): one engine per
configuration in this process (no speculation, vLLM's `dflash`, `dflash_tfm` trees and
budgets), greedy and sampled, each greedy output compared with no speculation up to bf16
ties, kernel launches and CUDA-graph dispatch counted (`launch_counts`), one report table
written after every configuration.

``runner``: "v1" runs every configuration on model runner V1; "v2" runs every
configuration on model runner V2 (vLLM 0.33's GPU default; dflash_tfm through
vllm_glue/v2, chosen with VLLM_USE_V2_MODEL_RUNNER=1 until V2 is its default).
"""

from __future__ import annotations

import collections
import gc
import json
import os
import time
import traceback
from pathlib import Path

from vllm_tfm.benchmarks.step_phases import (
    PHASES,
    collect_steps,
    install_on_worker,
    phase_medians,
    profile_engine,
    profile_file_name,
    set_recording,
)
from vllm_tfm.tiny.engine_runs import (
    PROMPTS,
    compare_greedy,
    timed_generate,
    timed_one_at_a_time,
)
from vllm_tfm.tiny.launch_counts import (
    GDN_VERIFY_KERNELS,
    LAUNCHES,
    count_graph_dispatch,
    count_draftless_steps,
    count_graphed_commits,
    count_mixed_gdn_calls,
    count_project_kernel_launches,
    graph_summary,
    missing_kernels,
)

HARNESS_LIMITS = (
    "Harness limits: vLLM's Python code (the version in the header) on torch 2.11 without "
    "its compiled ops (tools/gpu_vllm): CUDA graphs as --cudagraphs sets them, TRITON_ATTN, Triton GDN, "
    "norms/RoPE/SiLU in pure torch, the model runner in the header. Tiny models (hidden 256, "
    "8 layers): a step costs its launches and host work, not its weights' bytes, so tokens/s "
    "here are not the large-model regime (tools/bench_speed.py measures that); with `build`'s "
    "random drafter and Weaver acceptance is low and timings are functional only."
)
RUNNERS = ("v1", "v2")
# Environment of the GPU harness's engines (one process, vLLM's own sampler, no hub, no
# usage stats); set before vLLM reads it, values the caller set win.
HARNESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "TOKENIZERS_PARALLELISM": "false"}


def set_harness_env() -> None:
    for key, value in HARNESS_ENV.items():
        os.environ.setdefault(key, value)

ENGINE_KWARGS = dict(
    enforce_eager=True, dtype="bfloat16", seed=0, max_model_len=1024, max_num_seqs=8,
    enable_prefix_caching=False, gpu_memory_utilization=0.1, kv_cache_memory_bytes=1 << 30,
    compilation_config={"custom_ops": ["none"]}, attention_config={"backend": "TRITON_ATTN"},
    additional_config={"gdn_prefill_backend": "triton"}, disable_log_stats=False,
)


# Compilation settings by --cudagraphs. "default" is vLLM's own (torch.compile, FULL and
# PIECEWISE graphs), minus the harness's need for pure-torch custom ops; "full-decode" is
# the cheapest graphed setting the harness runs (no torch.compile, full decode graphs);
# "compiled-full-decode" adds vLLM's default torch.compile, whose Inductor kernels fuse the
# norms, activations and rotary that the harness otherwise runs as several torch kernels
# each (it has no compiled vLLM ops): the step a user's vLLM build runs.
# Captures up to 1024 tokens (vLLM's default stops at 512): 8 prompts of a budget-64 tree
# are 520 tokens a step, which must replay a FULL graph too.
CUDA_GRAPH_SETTINGS = {
    "off": {},
    "full-decode": dict(enforce_eager=False, compilation_config={
        "mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "custom_ops": ["none"],
        "max_cudagraph_capture_size": 1024}),
    "compiled-full-decode": dict(enforce_eager=False, compilation_config={
        "cudagraph_mode": "FULL_DECODE_ONLY", "custom_ops": ["none"],
        "max_cudagraph_capture_size": 1024}),
    "default": dict(enforce_eager=False, compilation_config={
        "custom_ops": ["none"], "max_cudagraph_capture_size": 1024}),
}


def configurations(models: Path) -> list[tuple[str, str | None, dict | None]]:
    """(label, tree kind or None, speculative_config) in priority order."""
    dflash = {"model": str(models / "dflash"), "attention_backend": "TRITON_ATTN"}
    # `build` writes weaver.pth; the trained family (models/tiny_trained) a safetensors dir
    weaver = models / "weaver" if (models / "weaver").is_dir() else models / "weaver.pth"

    def tfm(tree: str, budget: int) -> tuple[str, str, dict]:
        # Every step at the configured budget: under CUDA graphs only trees of
        # num_speculative_tokens drafts replay vLLM's FULL decode graphs.
        config = {**dflash, "method": "dflash_tfm", "tree": tree, "num_speculative_tokens": budget,
                  "budget_by_batch": [[1 << 20, budget]]}
        if tree == "weaver":
            config["weaver"] = str(weaver)
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


def select_runner(runner: str) -> None:
    """Make the next engine of this process take model runner ``runner``. vLLM caches its
    environment once an engine core started: drop the cache (as the plugin does when it
    selects V1 for dflash_tfm)."""
    import os

    import vllm.envs as envs

    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {list(RUNNERS)}, got {runner!r}")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    envs.disable_envs_cache()


def _dispatch_key(descriptor, tree_step: bool) -> str:
    return f"{'tree' if tree_step else 'other'} steps, graph mode {descriptor.cg_mode.name}"


def count_v2_graph_dispatch(counts=LAUNCHES, key=_dispatch_key) -> None:
    """Count model runner V2's target forwards in ``counts`` under ``key(descriptor, tree
    step)`` (None: not counted); by default by CUDA-graph mode, split into the steps of a
    dflash_tfm engine with drafts scheduled (tree steps) and the others, as
    launch_counts.count_graph_dispatch does for V1. Dummy runs (capture, profiling) are
    left out."""
    from vllm.v1.worker.gpu import model_runner as v2

    from vllm_tfm.vllm_glue.config import tfm_options

    dispatch = v2.dispatch_cg_and_sync_dp
    execute = v2.GPUModelRunner.execute_model
    running = []  # (dummy run, tree step) of the execute_model calls in progress

    def execute_model(self, scheduler_output, *args, dummy_run: bool = False, **kwargs):
        trees = (tfm_options(self.vllm_config) is not None
                 and bool(getattr(scheduler_output, "scheduled_spec_decode_tokens", None)))
        running.append((dummy_run, trees))
        try:
            return execute(self, scheduler_output, *args, dummy_run=dummy_run, **kwargs)
        finally:
            running.pop()

    def dispatch_cg_and_sync_dp(*args, **kwargs):
        result = dispatch(*args, **kwargs)
        if running and not running[-1][0]:
            name = key(result[0], running[-1][1])
            if name is not None:
                counts[name] += 1
        return result

    v2.GPUModelRunner.execute_model = execute_model
    v2.dispatch_cg_and_sync_dp = dispatch_cg_and_sync_dp


def on_tiny_engine(models: Path, speculative_config: dict | None, max_num_seqs: int,
                   cudagraphs: str, runner: str, use, tfm_sync_scheduling: bool = False,
                   max_model_len: int = ENGINE_KWARGS["max_model_len"]):
    """``use(llm)`` on an `LLM` of the models of `build` (ENGINE_KWARGS, the --cudagraphs
    settings, model runner ``runner``; ``tfm_sync_scheduling``: a dflash_tfm engine turns
    async scheduling off, the others keep vLLM's default, on for V2), freed
    afterwards: (what it returned, the seconds the engine took to start)."""
    import torch
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    select_runner(runner)
    started = time.perf_counter()
    tfm = (speculative_config or {}).get("method") == "dflash_tfm"
    llm = LLM(model=str(models / "target"), speculative_config=speculative_config,
              **{**ENGINE_KWARGS, "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
                 **CUDA_GRAPH_SETTINGS[cudagraphs],
                 **({"async_scheduling": False} if tfm and tfm_sync_scheduling else {})})
    start_s = time.perf_counter() - started
    try:
        return use(llm), start_s
    finally:
        del llm
        gc.collect()
        # An engine that raised leaves its process groups behind (on the H200 the next
        # engine found no pipeline group): every configuration starts from a clean slate.
        cleanup_dist_env_and_memory()
        torch.cuda.empty_cache()


def run_config(models: Path, speculative_config: dict | None, prompts: list[str],
               max_tokens: list[int], with_margins: bool, max_num_seqs: int,
               cudagraphs: str = "off", runner: str = "v1",
               tfm_sync_scheduling: bool = False,
               max_model_len: int = ENGINE_KWARGS["max_model_len"],
               profile_path: Path | None = None) -> dict:
    """Warm-up, then timed greedy runs (the batch, then each prompt alone; with logprobs
    too when ``with_margins``) and a sampled one; ``max_tokens[i]`` new tokens for prompt
    ``i``. With ``profile_path``, the first prompt's greedy run alone is also profiled
    (``step_phases.profile_engine``) into that file."""
    from vllm import SamplingParams

    def runs(llm) -> dict:
        result: dict = {}
        llm.collective_rpc(install_on_worker, args=(runner,))
        warm = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        # and one request alone: batch-1 steps compile kernels of their own (Triton
        # specialises integer arguments equal to 1), which the timed batch-1 run must not pay
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        result["warmup_s"] = time.perf_counter() - warm
        greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for n in max_tokens]
        result["greedy"] = timed_generate(llm, prompts, greedy)
        # Batch 1 with each engine step split into its phases (step_phases' timer).
        llm.collective_rpc(set_recording, args=(True,))
        result["greedy_alone"] = timed_one_at_a_time(llm, prompts, greedy)
        llm.collective_rpc(set_recording, args=(False,))
        steps = llm.collective_rpc(collect_steps)[0]
        result["phases_alone"] = {
            "wall_ms": 1e3 * result["greedy_alone"]["seconds"] / max(1, len(steps)),
            "decode_steps": sum(step["decode"] for step in steps),
            **phase_medians([step for step in steps if step["decode"]]),
        }
        if profile_path is not None:
            profile_engine(llm, lambda: llm.generate(prompts[:1], greedy[:1], use_tqdm=False),
                           profile_path)
        if with_margins:
            logprobs = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                       logprobs=2) for n in max_tokens]
            result["greedy_logprobs"] = timed_generate(llm, prompts, logprobs)
        sampled = [SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=n,
                                  ignore_eos=True) for i, n in enumerate(max_tokens)]
        result["sampled"] = timed_generate(llm, prompts, sampled)
        return result

    result, start_s = on_tiny_engine(models, speculative_config, max_num_seqs, cudagraphs,
                                     runner, runs, tfm_sync_scheduling, max_model_len)
    return {"start_s": start_s, **result}


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


def write_report(rows: list[dict], out: Path, header: str) -> str:
    lines = [
        header, "",
        "| configuration | greedy tok/s | greedy tau | greedy tok/s, batch 1 | tau, batch 1 "
        "| sampled tok/s | sampled tau | greedy vs no-spec | tree kernels "
        "| target forwards by graph mode |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['config']} | FAILED: {row['error'][:120]} | | | | | | | | |")
            continue
        if "skipped" in row:
            lines.append(f"| {row['config']} | skipped ({row['skipped']}) | | | | | | | | |")
            continue
        g, alone, s = row["greedy"], row["greedy_alone"], row["sampled"]
        lines.append(
            f"| {row['config']} | {g['tokens_per_s']:.1f} | {_fmt(g['tau'], '.2f')} "
            f"| {alone['tokens_per_s']:.1f} | {_fmt(alone['tau'], '.2f')} "
            f"| {s['tokens_per_s']:.1f} | {_fmt(s['tau'], '.2f')} | {row.get('equality', '-')} "
            f"| {row.get('kernels', '-')} | {graph_summary(row.get('launches', {}))} |"
        )
    lines += ["", "Batch 1, the decode steps' medians (ms; step_phases: the step from execute_model "
              "to the end of sample_tokens, its phases, the rest; wall = the batch-1 run's "
              "seconds over its engine steps, prefills included):", "",
              "| configuration | decode steps | wall a step | step | "
              + " | ".join(PHASES) + " | rest |",
              "|---|--:|--:|--:|" + "--:|" * (len(PHASES) + 1)]
    for row in rows:
        phases = row.get("phases_alone")
        if phases is None or phases["step_ms"] is None:
            continue
        rest = phases["step_ms"] - sum(phases[name] for name in PHASES)
        cells = [phases["wall_ms"], phases["step_ms"], *(phases[name] for name in PHASES), rest]
        lines.append(f"| {row['config']} | {phases['decode_steps']} | "
                     + " | ".join(f"{value:.2f}" for value in cells) + " |")
    lines += ["", HARNESS_LIMITS]
    text = "\n".join(lines) + "\n"
    (out / "gpu_e2e.md").write_text(text)
    (out / "gpu_e2e.json").write_text(json.dumps(rows, indent=1))
    return text


def _equality(base: dict, spec: dict) -> tuple[str, bool]:
    """'matched/total' greedy tokens and whether every difference is a bf16 tie."""
    rows = compare_greedy(
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


def tree_kernels_ran_eagerly(launches: dict, models: Path) -> bool:
    """Whether the GDN tree verify launched at every GDN layer of every tree step that did
    not replay a FULL graph (a lower bound: captures launch it too)."""
    layer_types = json.loads((models / "target" / "config.json").read_text())["layer_types"]
    eager_steps = sum(launches.get(f"tree steps, graph mode {mode}", 0)
                      for mode in ("NONE", "PIECEWISE"))
    verify_launches = sum(launches.get(name, 0) for name in GDN_VERIFY_KERNELS)
    return verify_launches >= eager_steps * layer_types.count("linear_attention")


def run_all(models: Path, out: Path, max_tokens: int, deadline_s: float, staggered: bool,
            config_words: list[str] | None, cudagraphs: str = "off",
            runner: str = "v1", tfm_sync_scheduling: bool = False,
            max_model_len: int = ENGINE_KWARGS["max_model_len"], profile: bool = False) -> int:
    import torch
    import triton

    import vllm
    from vllm_tfm.vllm_glue import register

    register()  # the plugin's entry point is not installed in the harness: register here
    count_project_kernel_launches()
    count_mixed_gdn_calls()
    count_graph_dispatch()
    count_v2_graph_dispatch()
    count_graphed_commits()
    if runner == "v2":
        count_draftless_steps()
    prompts = list(PROMPTS)
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
    if max_model_len != ENGINE_KWARGS["max_model_len"]:
        # Requests that reach it end there; vLLM schedules fewer drafts as they near it,
        # the last step of each none.
        batching += f", max_model_len {max_model_len}"
    header = (f"dflash_tfm end to end on {torch.cuda.get_device_name(0)}: models {models}, "
              f"vLLM {vllm.__version__}, "
              f"torch {torch.__version__}, triton {triton.__version__}; {batching}; "
              f"tau = mean accepted length incl. bonus (vLLM spec-decode counters); "
              f"CUDA graphs {cudagraphs}: {CUDA_GRAPH_SETTINGS[cudagraphs] or 'enforce_eager'}; "
              f"model runner {runner.upper()}"
              f"{'; dflash_tfm with sync scheduling' if tfm_sync_scheduling else ''}")
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
                                max_num_seqs=max_num_seqs, cudagraphs=cudagraphs,
                                runner=runner, tfm_sync_scheduling=tfm_sync_scheduling,
                                max_model_len=max_model_len,
                                profile_path=out / f"profile_{profile_file_name(label)}.txt"
                                if profile else None)
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
        if tree is not None and launches.get("tree steps, graph mode PIECEWISE") and (
                runner == "v1" or not tree_kernels_ran_eagerly(launches, models)):
            # V1 runs a tree step eagerly outside its FULL graphs. On V2 a mixed batch
            # (prompt chunks beside trees) takes vLLM's PIECEWISE graphs, which split at
            # the attention and GDN-core ops, so the tree kernels must launch between the
            # pieces at every GDN layer of every such step.
            row["kernels"] = "TREE STEPS REPLAYED A PIECEWISE GRAPH"
            failed = True
        elif tree is not None and cudagraphs != "off" and not launches.get(
                "tree steps, graph mode FULL"):
            row["kernels"] = "NO TREE STEP REPLAYED A FULL GRAPH"
            failed = True
        elif tree is not None:
            missing = missing_kernels(launches, tree, staggered)
            row["kernels"] = "all ran" if not missing else "MISSING " + ", ".join(missing)
            failed |= bool(missing)
        rows.append(row)
        g, s = result["greedy"], result["sampled"]
        alone = result["greedy_alone"]
        print(f"    start {result['start_s']:.1f} s, warm-up {result['warmup_s']:.1f} s; greedy "
              f"{g['tokens_per_s']:.1f} tok/s tau {_fmt(g['tau'], '.2f')}; batch 1 "
              f"{alone['tokens_per_s']:.1f} tok/s tau {_fmt(alone['tau'], '.2f')}; sampled "
              f"{s['tokens_per_s']:.1f} tok/s tau {_fmt(s['tau'], '.2f')}; "
              f"{row.get('equality', '')} {row.get('kernels', '')}", flush=True)
        print(f"    launches {launches}", flush=True)
        write_report(rows, out, header)
    print(write_report(rows, out, header), flush=True)
    return 1 if failed else 0
