"""Model-runner (V1) hooks: tree inputs, tree verification, commit, proposer swap.

Every wrapper is a no-op unless the runner's VllmConfig runs dflash_tfm.
The order within one engine step is:

    _prepare_inputs   -> TreeStep built, RoPE positions = prefix + depth, activated
    _determine_batch_execution_and_padding -> a step with trees runs eagerly
    (target forward)  -> attention / GDN patches read the active TreeStep
    _sample           -> tree verifier: accepted path + bonus per request
    _update_states... -> commit the accepted path (KV, GDN, conv); deactivate
    propose_draft...  -> the tree proposer drafts the next trees
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from triton_ops.tree_metadata import build_tree_metadata
from vllm_tfm.vllm_glue import tree_step as tree_step_module
from vllm_tfm.vllm_glue.config import tfm_options
from vllm_tfm.vllm_glue.tree_step import TreeStep


def _enabled(runner) -> bool:
    return getattr(runner, "_tfm_options", None) is not None


def wrap_init(original):
    @functools.wraps(original)
    def __init__(self, vllm_config, device, *args, **kwargs):
        original(self, vllm_config, device, *args, **kwargs)
        self._tfm_options = tfm_options(vllm_config)
        if self._tfm_options is None:
            return
        from vllm_tfm.vllm_glue.proposer import TreeProposer

        self.drafter = TreeProposer(vllm_config, device, self, self._tfm_options)
        self._tfm_step = None
        self._tfm_hidden_states = None

    return __init__


def _conv_width(runner) -> int:
    hf = runner.model_config.hf_config
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    return int(getattr(text, "linear_conv_kernel_dim", 4))


def _build_step(runner, scheduler_output, num_scheduled_tokens: np.ndarray, spec_metadata):
    num_reqs = runner.input_batch.num_reqs
    req_ids = list(runner.input_batch.req_ids[:num_reqs])
    num_drafts = np.asarray(spec_metadata.num_draft_tokens, dtype=np.int64)
    num_nodes = num_drafts + 1
    max_nodes = int(num_nodes.max())
    parents = np.full((num_reqs, max_nodes), -1, dtype=np.int64)
    proposer = runner.drafter
    for r, req_id in enumerate(req_ids):
        if num_drafts[r] > 0:
            parents[r, : num_nodes[r]] = proposer.scheduled_parents(req_id, int(num_nodes[r]))
    query_start = runner.query_start_loc.np[: num_reqs + 1].astype(np.int64)
    first_node_row = query_start[1:] - num_nodes
    node = np.arange(max_nodes)
    token_rows = np.where(
        node[None, :] < num_nodes[:, None], first_node_row[:, None] + node[None, :], -1
    )
    computed = runner.input_batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
    prefix_lens = computed + num_scheduled_tokens[:num_reqs] - num_nodes
    device = runner.device
    meta = build_tree_metadata(
        torch.from_numpy(parents).to(device),
        torch.from_numpy(num_nodes.astype(np.int32)).to(device),
        conv_width=_conv_width(runner),
        validate=False,
    )
    total = int(query_start[-1])
    return TreeStep(
        req_ids=req_ids,
        meta=meta,
        token_rows=torch.from_numpy(token_rows).to(device),
        prefix_lens=torch.from_numpy(prefix_lens.astype(np.int32)).to(device),
        num_scheduled=torch.from_numpy(num_scheduled_tokens[:num_reqs].astype(np.int32)),
        linear_positions=runner.positions[:total].clone(),
        has_trees=bool((num_drafts > 0).any()),
    )


def _apply_tree_positions(runner, step: TreeStep) -> None:
    """RoPE sees node j at prefix + depth(j); slots stay linear (prefix + j)."""
    rows = step.token_rows[step.meta.valid]
    node = torch.arange(step.meta.max_nodes, device=rows.device).expand_as(step.token_rows)
    shift = (node - step.meta.depths.long())[step.meta.valid]
    runner.positions[rows] -= shift
    if runner.uses_mrope:
        runner.mrope_positions.gpu[:, rows] -= shift


def wrap_prepare_inputs(original):
    @functools.wraps(original)
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = original(self, scheduler_output, num_scheduled_tokens)
        if not _enabled(self):
            return result
        spec_metadata = result[1]
        step = None
        if spec_metadata is not None:
            step = _build_step(self, scheduler_output, num_scheduled_tokens, spec_metadata)
            _apply_tree_positions(self, step)
        self._tfm_step = step
        tree_step_module.activate(step)
        return result

    return _prepare_inputs


def wrap_determine_batch_execution_and_padding(original):
    @functools.wraps(original)
    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        step = getattr(self, "_tfm_step", None)
        if _enabled(self) and step is not None and step.has_trees:
            # vLLM captured its CUDA graphs in dummy runs with no tree step
            # active: replaying one over tree rows would run the chain kernels
            # instead of the tree wrappers (silently wrong). Tree steps run
            # eagerly; steps without drafts still replay graphs.
            kwargs["force_eager"] = True
        return original(self, *args, **kwargs)

    return _determine_batch_execution_and_padding


def wrap_sample(original):
    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        step = getattr(self, "_tfm_step", None)
        if not _enabled(self) or spec_decode_metadata is None or step is None:
            return original(self, logits, spec_decode_metadata)
        if step.tree_requests().numel() == 0:
            # No drafts anywhere (e.g. a step of prompts): vLLM's sampler, and
            # every request's root is its accepted leaf.
            step.accepted_leaf = torch.zeros(len(step.req_ids), dtype=torch.int64,
                                             device=step.token_rows.device)
            return original(self, logits, spec_decode_metadata)
        from vllm_tfm.vllm_glue.verify import verify_step

        return verify_step(self, step, logits, spec_decode_metadata)

    return _sample


def wrap_update_states_after_model_execute(original):
    @functools.wraps(original)
    def _update_states_after_model_execute(self, output_token_ids, scheduler_output):
        original(self, output_token_ids, scheduler_output)
        if not _enabled(self):
            return
        tree_step_module.activate(None)
        step = self._tfm_step
        if step is None:
            return
        from vllm_tfm.vllm_glue.commit import commit_step

        commit_step(self, step)

    return _update_states_after_model_execute


def wrap_propose_draft_token_ids(original):
    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, *args, **kwargs):
        if _enabled(self):
            # Weaver reads the target's final-norm state of each bonus row.
            self.drafter.set_target_hidden_states(hidden_states, self._tfm_step)
        return original(self, scheduler_output, sampled_token_ids, sampling_metadata,
                        hidden_states, *args, **kwargs)

    return propose_draft_token_ids


def wrap_take_draft_token_ids(original):
    @functools.wraps(original)
    def take_draft_token_ids(self):
        drafts = original(self)
        if drafts is None or not _enabled(self):
            return drafts
        if not self.drafter.take_drafted():
            # vLLM skipped drafting (a context too close to max_model_len) and
            # left zero placeholders; they form no tree, so schedule none.
            drafts.draft_token_ids = [[] for _ in drafts.draft_token_ids]
            return drafts
        # Trees smaller than the budget are padded with -1: drop the padding.
        drafts.draft_token_ids = [
            [token for token in row if token >= 0] for row in drafts.draft_token_ids
        ]
        return drafts

    return take_draft_token_ids
