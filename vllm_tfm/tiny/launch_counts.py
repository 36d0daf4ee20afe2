"""Counters for the GPU check (tools/gpu_e2e.py), patched onto vLLM and Triton in this
process: launches of the project's Triton kernels, GDN calls that mix prompt and tree rows,
target forwards by the CUDA-graph mode vLLM dispatched (steps with trees and others), the
commits of FULL-graph steps (those replaying a commit graph among them), and model runner
V2's steps of one-node trees for decodes without drafts.
All counts accumulate in `LAUNCHES`.
"""

from __future__ import annotations

import collections

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
    "triton_ops.gdn_tree.chunk_triton._verify_output_kernel",
)
WEAVER_KERNELS = {"triton_ops.pool_logits.pool_logits._pool_logits_kernel": "pool logits"}

LAUNCHES: collections.Counter = collections.Counter()
MIXED_GDN = "GDN calls with prompt and tree rows"
GRAPHED_COMMITS = "commits of FULL-graph steps"
COMMIT_GRAPH_REPLAYS = "commits of FULL-graph steps replaying a commit graph"
DRAFTLESS_STEPS = "V2 steps of decodes without drafts (one-node trees)"


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


def count_graphed_commits() -> None:
    """Count the commits of steps that replayed a FULL graph (either runner), and those
    among them that replayed a commit graph captured by an earlier commit (a commit graph's
    kernels are not counted as launches: a replay runs no ``JITFunction.run``)."""
    from vllm_tfm.vllm_glue.tree_graphs import GraphedTreeSteps

    original = GraphedTreeSteps.commit

    def commit(self, step, run):
        LAUNCHES[GRAPHED_COMMITS] += 1
        if self.has_commit_graph(step):
            LAUNCHES[COMMIT_GRAPH_REPLAYS] += 1
        return original(self, step, run)

    GraphedTreeSteps.commit = commit


def count_draftless_steps() -> None:
    """Count V2's tree steps made for batches whose decodes carry no drafts (vLLM's kernel
    warm-up runs some; in serving, requests whose drafts were all cut, e.g. at
    max_model_len)."""
    from vllm_tfm.vllm_glue.v2 import model_state

    original = model_state.batch_tree_step

    def batch_tree_step(*args, draftless: bool = False, **kwargs):
        if draftless:
            LAUNCHES[DRAFTLESS_STEPS] += 1
        return original(*args, draftless=draftless, **kwargs)

    model_state.batch_tree_step = batch_tree_step


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
                     if " steps, graph mode " in name
                     or name in (GRAPHED_COMMITS, COMMIT_GRAPH_REPLAYS, DRAFTLESS_STEPS)) or "-"


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
