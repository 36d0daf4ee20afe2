"""The V2 tree speculator: vLLM's DFlash speculator drafting trees.

vLLM's DFlash block is ``1 + num_speculative_steps`` queries, and a tree engine's
num_speculative_tokens is its budget; the speculator is therefore built from a copy of the
config whose num_speculative_tokens is the draft depth D. Its graphed draft forward
(``_generate_draft``, which vLLM captures as a FULL graph) keeps the D positions' top-P
candidate pools and DFlash states in persistent buffers instead of sampling a chain; the
tree builders grow one tree per request from them (eagerly), the trees are kept by
request slot and vLLM receives [R, budget] drafts, the nodes after each root.

Before the DFlash context pass the accepted path of each request is moved to the front of
its rows (``TreeStep.context_order``): vLLM's DFlash reads the first
``query_len - num_rejected`` rows of each request as the committed context.
"""

from __future__ import annotations

import copy

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_tfm.drafting.draft_round import CandidatePools, candidate_pools, draft_depth, draft_trees
from vllm_tfm.options import TfmOptions
from vllm_tfm.vllm_glue.proposer import _embedding_and_head
from vllm_tfm.vllm_glue.tree_step import install_step_slot
from vllm_tfm.vllm_glue.v2.engine import TreeEngine, install_engine
from vllm_tfm.vllm_glue.v2.trees import SlotTrees


def _depth_config(vllm_config, depth: int):
    """A shallow copy of ``vllm_config`` whose num_speculative_tokens is ``depth``."""
    speculative = copy.copy(vllm_config.speculative_config)
    speculative.num_speculative_tokens = depth
    config = copy.copy(vllm_config)
    config.speculative_config = speculative
    return config


class TreeSpeculator(DFlashSpeculator):
    _speculator_name = "DFlash tree"

    def __init__(self, vllm_config, device: torch.device, options: TfmOptions) -> None:
        self.options = options
        self.weaver = None
        depth = draft_depth(options.budget, options.draft_depth)
        if options.tree == "weaver":
            self.weaver = self._load_weaver(vllm_config, device)
            depth = draft_depth(options.budget, options.draft_depth, self.weaver)
        super().__init__(_depth_config(vllm_config, depth), device)
        budget = options.budget
        self.budget = budget
        num_slots = self.max_num_reqs
        pool = options.candidate_pool
        self.pool_ids = torch.zeros(num_slots, depth, pool, dtype=torch.int64, device=device)
        self.pool_scores = torch.zeros(num_slots, depth, pool, dtype=torch.float32,
                                       device=device)
        self.dflash_states = torch.zeros(num_slots, depth, self.hidden_size, dtype=self.dtype,
                                         device=device)
        context = vllm_config.compilation_config.static_forward_context
        self.engine = TreeEngine(
            trees=SlotTrees.allocate(num_slots, 1 + budget, budget, device),
            slot=install_step_slot(context), draft_layer_names=set())
        install_engine(context, self.engine)

    def _load_weaver(self, vllm_config, device):
        from vllm_tfm.drafting.weaver_checkpoint import load_weaver

        text = vllm_config.model_config.hf_config
        text = text.get_text_config() if hasattr(text, "get_text_config") else text
        return load_weaver(self.options.weaver,
                           target_hidden_size=text.hidden_size,
                           target_vocab_size=text.vocab_size,
                           dtype=vllm_config.model_config.dtype, device=device)

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        self.engine.draft_layer_names = set(self.draft_attn_layer_names)
        if self.weaver is not None:
            self.weaver.prepare_tables(*_embedding_and_head(target_model))

    def _generate_draft(self, num_reqs, num_tokens_padded, attn_metadata, slot_mappings,
                        num_tokens_across_dp,
                        cudagraph_runtime_mode=CUDAGraphMode.NONE) -> None:
        """The DFlash block's forward (vLLM graphs it): pools and states of the D
        positions into the persistent buffers, no chain sampled."""
        hidden = self._run_model(num_tokens_padded, attn_metadata, slot_mappings,
                                 num_tokens_across_dp, cudagraph_runtime_mode)
        depth = self.num_speculative_steps
        states = hidden[self.sample_indices[: num_reqs * depth]]
        logits = self.model.compute_logits(states)
        pools = candidate_pools(logits.view(num_reqs, depth, -1), self.options.candidate_pool)
        self.pool_ids[:num_reqs] = pools.ids
        self.pool_scores[:num_reqs] = pools.scores
        self.dflash_states[:num_reqs] = states.view(num_reqs, depth, -1)

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, last_sampled,
                next_prefill_tokens, temperature, seeds, *args, dummy_run: bool = False,
                num_speculative_tokens: int | None = None, **kwargs) -> torch.Tensor:
        engine = self.engine
        engine.slot.step = None  # the drafter's layers run no tree
        step, engine.step = engine.step, None
        num_reqs = input_batch.num_reqs
        if step is not None and step.accepted_leaf is not None and not dummy_run:
            # Weaver's h_v: the target's final state at the row that produced the root.
            h_v = last_hidden_states.index_select(0, step.bonus_rows())
            order = step.context_order()[: input_batch.num_tokens]
            last_hidden_states = _permute(last_hidden_states, order)
            if aux_hidden_states:
                aux_hidden_states = [_permute(h, order) for h in aux_hidden_states]
        else:  # prompt chunks only: each root came from the request's last row
            ends = input_batch.query_start_loc[1 : num_reqs + 1].long() - 1
            h_v = last_hidden_states.index_select(0, ends)
        super().propose(input_batch, attn_metadata, slot_mappings, last_hidden_states,
                        aux_hidden_states, num_sampled, num_rejected, last_sampled,
                        next_prefill_tokens, temperature, seeds, *args, dummy_run=dummy_run,
                        num_speculative_tokens=num_speculative_tokens, **kwargs)
        slots = input_batch.idx_mapping[:num_reqs]
        if dummy_run or num_speculative_tokens == 0 or num_reqs == 0:
            return engine.trees.draft_tokens(slots)
        roots = last_sampled[slots.long(), 0]  # vLLM keeps [max_num_reqs, 1]
        trees = draft_trees(
            self.options.tree, roots,
            CandidatePools(self.pool_ids[:num_reqs], self.pool_scores[:num_reqs]),
            self.budget, weaver=self.weaver, h_v=h_v,
            dflash_hidden=self.dflash_states[:num_reqs], fanout=self.options.fanout,
            expand_width=self.options.expand_width_for(self.budget), validate=False)
        engine.trees.store(slots, trees)
        return engine.trees.draft_tokens(slots)


def _permute(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``rows`` with its first len(order) rows taken in ``order`` (the rest kept)."""
    count = order.shape[0]
    return torch.cat([rows[:count].index_select(0, order), rows[count:]])

