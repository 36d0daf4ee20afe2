"""Commit the accepted path of every request into the caches, after verification.

Only accepted nodes ever reach the caches: full-attention K/V rows move from
their linear slots (prefix + node index) to prefix + depth; GDN recurrent and
conv states advance along the path from the committed state, in place.
"""

from __future__ import annotations

import torch

from vllm_tfm.vllm_glue.attention import cpu_key_value_views
from vllm_tfm.vllm_glue.tree_step import GDNCommitRecord

# Attention backends whose paged caches the tree kernels read.
TREE_ATTENTION_BACKENDS = ("CPU_ATTN", "TRITON_ATTN")


def key_value_views(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention layer's cache as the (keys, values) views ``tree_kv_commit``
    takes: [blocks, block_size, kv_heads, D], or tiled under CPU_ATTN's amx."""
    backend = layer.attn_backend.get_name()
    if backend == "CPU_ATTN":
        return cpu_key_value_views(layer.kv_cache, layer.isa)
    if backend == "TRITON_ATTN":
        from vllm_tfm.vllm_glue.cuda_attention import triton_key_value_views

        return triton_key_value_views(layer.kv_cache, layer.impl.head_size)
    raise RuntimeError(
        f"dflash_tfm supports the attention backends {list(TREE_ATTENTION_BACKENDS)}; "
        f"layer {layer.layer_name!r} uses {backend}"
    )


def conv_width(model_config) -> int:
    """The target's GDN conv kernel width (whose last width - 1 inputs a commit keeps)."""
    hf = model_config.hf_config
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    return int(getattr(text, "linear_conv_kernel_dim", 4))


def attention_layers_by_group(kv_cache_config, context: dict,
                              drafter_layers) -> list[tuple[int, list[str]]]:
    """The target's full-attention layers (``context``: the static forward context), by
    KV-cache group, leaving out the drafter's."""
    from vllm.model_executor.layers.attention import Attention

    groups = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        names = [name for name in group.layer_names
                 if name not in drafter_layers and isinstance(context.get(name), Attention)]
        if names:
            groups.append((gid, names))
    return groups


def _attention_layers_by_group(runner) -> list[tuple[int, list[str]]]:
    """A V1 runner's ``attention_layers_by_group`` (cached on the runner)."""
    cached = getattr(runner, "_tfm_attention_groups", None)
    if cached is None:
        cached = attention_layers_by_group(
            runner.kv_cache_config, runner.compilation_config.static_forward_context,
            set(getattr(runner.drafter, "_draft_attn_layer_names", ()) or ()))
        runner._tfm_attention_groups = cached
    return cached


def commit_kv(context: dict, groups: list[tuple[int, list[str]]], block_table, step) -> None:
    """Move each tree request's accepted K/V rows to prefix + depth in every layer of
    ``groups``; ``block_table(gid)`` gives that group's [R, blocks] table."""
    from triton_ops.tree_attention import tree_kv_commit

    for gid, names in groups:
        views = [key_value_views(context[name]) for name in names]
        tree_kv_commit([keys for keys, _ in views], [values for _, values in views],
                       block_table(gid).to(torch.int32), step.prefix_lens, step.meta,
                       step.accepted_leaf)


def commit_step(runner, step) -> None:
    """Advance every request's caches along its accepted path, in place: a commit that
    raises part-way leaves the caches of `written_requests` unknown (they cannot be
    rolled back or committed twice)."""
    if step.has_trees:
        num_reqs = len(step.req_ids)
        commit_kv(runner.compilation_config.static_forward_context,
                  _attention_layers_by_group(runner),
                  lambda gid: runner.input_batch.block_table[gid].get_device_tensor(num_reqs),
                  step)
    commit_gdn_records(step.gdn_records.values(), step.accepted_leaf)


def commit_gdn_records(records, accepted_leaf: torch.Tensor, backend: str = "auto") -> None:
    """Advance each GDN layer's recurrent and conv state of its requests along their
    accepted paths (``accepted_leaf`` [R], by the step's requests).

    The layers that share their requests and tensor layouts (all of a step's) commit
    together: on the Triton path one launch for every layer's recurrent state and one for
    every layer's conv state, where two per layer would be 96 latency-bound kernels a step
    at Qwen3.6-27B's 48 GDN layers. Their offset tables are made by the first commit over a
    graph's buffers (the eager one before its capture) and found by the captured one.
    """
    from triton_ops.gdn_tree import gdn_tree_commit_layers
    from triton_ops.tree_conv import tree_conv1d_commit_layers

    groups: dict[tuple, list[GDNCommitRecord]] = {}
    for record in records:
        out = record.verify_out
        tensors = (record.ssm_state, record.slots, record.conv_state, record.conv_inputs,
                   out.delta, out.gate_sum, out.k_normed)
        layout = tuple((t.dtype, t.shape, t.stride()) for t in tensors)
        groups.setdefault((id(record.requests), layout), []).append(record)
    for group in groups.values():
        first = group[0]
        slots = [record.slots for record in group]
        leaf = accepted_leaf.index_select(0, first.requests)
        gdn_tree_commit_layers([record.ssm_state for record in group], slots, first.meta,
                               [record.verify_out for record in group], leaf, backend=backend)
        tree_conv1d_commit_layers([record.conv_state for record in group], slots,
                                  [record.conv_inputs for record in group], first.meta, leaf,
                                  backend=backend)


def written_requests(step) -> list[int]:
    """Indices of the requests whose caches `commit_step` writes: the tree requests
    (their K/V rows) and every request a GDN layer recorded (all decodes, drafts or
    not; prompt chunks wrote their state in the forward)."""
    written = set(step.tree_requests().tolist())
    for record in step.gdn_records.values():
        written.update(record.requests.tolist())
    return sorted(written)


def publish_commit(runner, num_reqs: int) -> None:
    """Slot 0 and the first conv columns now hold the committed state: tell vLLM's
    readers so (its convention resumes from slot num_accepted - 1)."""
    runner.num_accepted_tokens.gpu[:num_reqs] = 1
    # vLLM's own device-to-host copy of the counts may still be in flight (CUDA):
    # queue ours behind it on the same stream, and its event behind ours.
    runner.input_batch.num_accepted_tokens_cpu_tensor[:num_reqs].copy_(
        runner.num_accepted_tokens.gpu[:num_reqs], non_blocking=True
    )
    if runner.num_accepted_tokens_event is not None:
        runner.num_accepted_tokens_event.record()
