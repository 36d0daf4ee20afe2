"""The V2 tree speculator: vLLM's DFlash speculator drafting trees.

vLLM's DFlash block is ``1 + num_speculative_steps`` queries, and a tree engine's
num_speculative_tokens is its budget; the speculator is therefore built from a copy of the
config whose num_speculative_tokens is the draft depth D. Its draft forward
(``_generate_draft``) keeps the D positions' top-P candidate pools instead of sampling a
chain, and grows the trees from them right there (``_grow_trees``), writing each request's
tree into its slot of :class:`.trees.SlotTrees`; vLLM receives [R, budget] drafts, the nodes
after each root.

The round runs inside vLLM's own FULL draft graph, not in a second graph of ours:
``_generate_draft`` is what vLLM captures, once per padded request count its dispatch picks
(``DFlashCudaGraphManager``; the draft step is uniform, so it replays whenever the batch fits
a captured size, prompt chunks in the target batch or not). So a replay is the DFlash forward
and the whole round with no launch gap between them, the round is bucketed exactly as the
drafter is, its intermediates share vLLM's graph pool, and vLLM's memory profile
(``profile_cudagraph_memory`` captures the speculator's graphs in full, the profile run
drafts at the largest batch) counts them before the KV cache is sized. A batch with no
captured size, or an engine without graphs, runs the same ``_generate_draft`` eagerly.
Every input the round reads is in place before the replay: the roots are the bonus tokens
vLLM's ``prepare_dflash_inputs`` wrote into the block's first query rows, h_v and the
request slots are copied into persistent buffers by ``propose`` (``_stage_round``), the
pools and DFlash states are made in the graph. A replay computes trees for the padded rows
too (every op of a round is per request): their slot index is a spare slot past the
requests', so they land there.

Sampled trees (``verify`` "auto" / "traversal", ``verify.sampled_tree_rows``): the host
knows which rows want one from V2's per-slot temperatures (``TreeEngine.temperature``)
and records it per slot for the verifier (``SlotTrees.sampled``). Each step runs one of
three rounds (``RoundMode``), each captured in its own set of draft graphs per k: a batch
with no such request the deterministic round; a batch of only such requests (every
request sampled, the common case at T > 0) the sampled round, which grows sampled trees
alone; a mixed batch the mixed round, which grows both tree kinds for every row and keeps,
row by row on the device, the sampled tree where ``round_sampled`` marks the row
(``draft_trees_by_mask``). So neither a greedy nor an all-sampled batch pays for the
other kind's round. A row's draws are seeded by its request's seed and the position of the
tree's root (``_draw_seeds``), as its verification is (``v2/verify.py::step_seeds``): a
seeded request reproduces, and its tree is the same in a sampled and in a mixed round.

A step's budget k is vLLM's (``propose(..., num_speculative_tokens=k)``): the scheduler
reads it off the batch-size schedule (``num_speculative_tokens_per_batch_size``, the
plugin's budget rule, vllm_glue/config.py) from the number of scheduled requests, and
the runner masks drafts past k with -1 (so does ``SlotTrees.draft_tokens``). vLLM keys
its DFlash draft graphs by padded request count only (the block is D queries whatever
k), so the speculator holds one vLLM graph manager per k of the schedule
(``round_budgets``), each capturing the round of that k, and replays the one of the
step's k. The graphs of a k also store the drafter's context K/V of every row of a tree
step, 1 + k a request (``_num_graph_context_tokens``), so no context row is left to an
eager pass before the replay.

Before the DFlash context pass the accepted path of each request is moved to the front of
its rows (``TreeStep.context_order``): vLLM's DFlash reads the first
``query_len - num_rejected`` rows of each request as the committed context.
"""

from __future__ import annotations

import copy
import enum

import numpy as np
import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_tfm.drafting.draft_round import (
    CandidatePools,
    draft_depth,
    draft_trees,
    draft_trees_by_mask,
)
from vllm_tfm.options import TfmOptions
from vllm_tfm.vllm_glue.proposer import _embedding_and_head, drafter_pools
from vllm_tfm.vllm_glue.tree_step import install_step_slot, to_device
from vllm_tfm.vllm_glue.v2.engine import TreeEngine, install_engine
from vllm_tfm.vllm_glue.v2.trees import SlotTrees
from vllm_tfm.vllm_glue.v2.verify import step_seeds
from vllm_tfm.vllm_glue.verify import draws_sampled_trees, sampled_tree_rows


class RoundMode(enum.Enum):
    """Which trees a draft round grows (each mode's round is captured in graphs of its
    own): deterministic trees only, sampled trees only, or both and a choice per row."""

    DETERMINISTIC = "deterministic"
    SAMPLED = "sampled"
    MIXED = "mixed"


def round_mode(sampled: np.ndarray) -> RoundMode:
    """The round of a batch whose rows want a sampled tree where ``sampled`` [R] says."""
    if not sampled.any():
        return RoundMode.DETERMINISTIC
    return RoundMode.SAMPLED if sampled.all() else RoundMode.MIXED


def _graphs_attribute(budget: int, mode: RoundMode) -> str:
    """The speculator attribute holding the draft graph manager of the rounds of budget
    ``budget`` and ``mode``."""
    return f"{mode.value}_draft_graphs_k{budget}"


def _depth_config(vllm_config, depth: int):
    """A shallow copy of ``vllm_config`` whose num_speculative_tokens is ``depth`` and
    with no batch-size schedule: the DFlash block is ``depth`` queries whatever a step's
    budget (else vLLM's draft graph manager would capture blocks of every 1 + k, which its
    dispatch never replays)."""
    speculative = copy.copy(vllm_config.speculative_config)
    speculative.num_speculative_tokens = depth
    speculative.num_speculative_tokens_per_batch_size = None
    config = copy.copy(vllm_config)
    config.speculative_config = speculative
    return config


class TreeSpeculator(DFlashSpeculator):
    _speculator_name = "DFlash tree"

    def __init__(self, vllm_config, device: torch.device, options: TfmOptions) -> None:
        self.options = options
        self.weaver = None
        # The largest round: vLLM's __init__ sizes its context staging by it
        # (_num_graph_context_tokens); _init_round sets the rounds.
        self.round_budget = options.budget
        depth = draft_depth(options.budget, options.draft_depth)
        if options.tree == "weaver":
            self.weaver = self._load_weaver(vllm_config, device)
            depth = draft_depth(options.budget, options.draft_depth, self.weaver)
        super().__init__(_depth_config(vllm_config, depth), device)
        self._init_round(vllm_config.compilation_config.static_forward_context, device,
                         round_budgets(vllm_config.speculative_config, self.max_num_reqs))

    def _init_round(self, static_forward_context: dict, device: torch.device,
                    budgets: tuple[int, ...]) -> None:
        """The round's persistent buffers, and the engine record shared with the model
        state; ``budgets``: every k a step may draft (``round_budgets``)."""
        self.budget = self.options.budget
        self.round_budgets = budgets
        # The budget and the mode of the next draft round (Python values: captured per
        # graph).
        self.round_budget = budgets[-1]
        self.round_mode = RoundMode.DETERMINISTIC
        self.draws_trees = draws_sampled_trees(self.options)
        num_slots = self.max_num_reqs
        # Per batch row: the slot its tree is written to (the spare slot num_slots for the
        # padded rows of a replay and for dummy runs), and Weaver's h_v.
        self.tree_slots = torch.full((num_slots,), num_slots, dtype=torch.int64, device=device)
        self.h_v = None
        if self.weaver is not None:
            self.h_v = torch.zeros(num_slots, self.weaver.config.d_model,
                                   dtype=self.weaver.dtype, device=device)
        depth = self.num_speculative_steps
        pools = None
        if self.draws_trees:
            # Per batch row of a mixed round: whether its tree is sampled; of a mixed or a
            # sampled round: its request's seed.
            self.round_sampled = torch.zeros(num_slots, dtype=torch.bool, device=device)
            self.round_seeds = torch.zeros(num_slots, dtype=torch.int64, device=device)
            pools = (depth, self.options.candidate_pool)
        self.engine = TreeEngine(
            trees=SlotTrees.allocate(num_slots + 1, 1 + self.budget, depth, device, pools),
            slot=install_step_slot(static_forward_context), draft_layer_names=set(),
            verify=self.options.verify)
        install_engine(static_forward_context, self.engine)

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

    @property
    def round_modes(self) -> tuple[RoundMode, ...]:
        """The modes of the rounds a step may run: the deterministic one, and where the
        options draw sampled trees the sampled and the mixed one."""
        if self.draws_trees:
            return (RoundMode.DETERMINISTIC, RoundMode.SAMPLED, RoundMode.MIXED)
        return (RoundMode.DETERMINISTIC,)

    @property
    def round_sampling(self) -> bool:
        """Whether the next round draws sampled trees (for some rows or all)."""
        return self.round_mode is not RoundMode.DETERMINISTIC

    def _round_kinds(self) -> list[tuple[int, RoundMode]]:
        """(budget, mode) of every round a step may run."""
        return [(budget, mode) for mode in self.round_modes for budget in self.round_budgets]

    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        """One vLLM DFlash graph manager per round budget and mode: its draft graph is
        keyed by the padded request count only (the block is D queries whatever k), so each
        round a step may run is captured in a set of graphs of its own."""
        for budget, mode in self._round_kinds():
            super().init_cudagraph_manager(cudagraph_mode)
            setattr(self, _graphs_attribute(budget, mode), self.query_cudagraph_manager)

    def round_graphs(self, mode: RoundMode) -> dict[int, object]:
        """By round budget: the vLLM DFlash graph manager whose graphs hold the round of
        that k and ``mode``. Each is an attribute of its own: vLLM's memory profiling
        (``profile_cudagraph_memory``) drops every graph-manager attribute of the
        speculator after it, as it drops ``query_cudagraph_manager``."""
        managers = {k: getattr(self, _graphs_attribute(k, mode), None)
                    for k in self.round_budgets}
        return {k: manager for k, manager in managers.items() if manager is not None}

    @property
    def draft_graphs(self) -> dict[int, object]:
        """The deterministic rounds' graph managers by budget."""
        return self.round_graphs(RoundMode.DETERMINISTIC)

    @property
    def all_draft_graphs(self) -> list:
        """The graph managers of every round a step may run."""
        return [manager for mode in self.round_modes
                for manager in self.round_graphs(mode).values()]

    def _use_round(self, budget: int, mode: RoundMode = RoundMode.DETERMINISTIC) -> None:
        """Draft the next round at ``budget`` in ``mode``, replaying that round's graphs
        (budget 0: vLLM's DFlash runs no round)."""
        if budget == 0:
            return
        if budget not in self.round_budgets:
            raise RuntimeError(
                f"dflash_tfm: a step drafts k = {budget}, not one of the round budgets "
                f"{list(self.round_budgets)} of the batch-size schedule")
        self.round_budget = budget
        self.round_mode = mode
        manager = self.round_graphs(mode).get(budget)
        if manager is not None:
            self.query_cudagraph_manager = manager

    def capture(self) -> None:
        # vLLM's capture runs _generate_draft (warm-up and captured pass) on dummy inputs:
        # their trees go to the spare slot, whatever the last step left in tree_slots.
        self.tree_slots.fill_(self.max_num_reqs)
        for budget, mode in self._round_kinds():
            self._use_round(budget, mode)
            super().capture()
        self._use_round(self.round_budgets[-1])

    def _num_graph_context_tokens(self, num_reqs: int) -> int:
        """Context rows a FULL draft graph of ``num_reqs`` stores: a tree step's whole
        target batch, 1 + k rows per request (vLLM's DFlash stores 1 + D, its chain's
        rows; the rows past those were stored eagerly before every replay, the
        drafter's context K/V projection launch by launch)."""
        return min(num_reqs * (1 + self.round_budget), self.max_num_tokens)

    def _generate_draft(self, num_reqs, num_tokens_padded, attn_metadata, slot_mappings,
                        num_tokens_across_dp,
                        cudagraph_runtime_mode=CUDAGraphMode.NONE) -> None:
        """The DFlash block's forward and the draft round, on ``num_reqs`` batch rows (the
        padded count under a FULL graph): pools of the D positions, no chain sampled, then
        the trees (vLLM captures all of it)."""
        hidden = self._run_model(num_tokens_padded, attn_metadata, slot_mappings,
                                 num_tokens_across_dp, cudagraph_runtime_mode)
        depth = self.num_speculative_steps
        states = hidden[self.sample_indices[: num_reqs * depth]]
        pools = drafter_pools(self.model, states, depth, self.options.candidate_pool)
        self._grow_trees(num_reqs, pools, states.view(num_reqs, depth, -1))

    def _grow_trees(self, num_reqs: int, pools: CandidatePools,
                    dflash_hidden: torch.Tensor) -> None:
        """The round of ``round_mode`` for batch rows 0..num_reqs-1 (``draft_trees``, with
        seeded draws in a sampled round; ``draft_trees_by_mask`` in a mixed one), into the
        slots ``_stage_round`` left in ``tree_slots``. Reads device buffers only (no host
        sync): it runs inside vLLM's capture."""
        block = self.num_query_per_req
        # prepare_dflash_inputs put each request's bonus token (its tree's root) first in
        # its block of query rows.
        roots = self.input_buffers.input_ids[: num_reqs * block : block].long()
        round_inputs = dict(
            weaver=self.weaver, h_v=None if self.h_v is None else self.h_v[:num_reqs],
            dflash_hidden=dflash_hidden, fanout=self.options.fanout,
            expand_width=self.options.expand_width_for(self.round_budget), validate=False)
        if self.round_mode is RoundMode.MIXED:
            trees = draft_trees_by_mask(
                self.options.tree, roots, pools, self.round_budget,
                self.round_sampled[:num_reqs], self._draw_seeds(num_reqs), **round_inputs)
        elif self.round_mode is RoundMode.SAMPLED:
            trees = draft_trees(self.options.tree, roots, pools, self.round_budget,
                                sample_seeds=self._draw_seeds(num_reqs), fixed_widths=True,
                                **round_inputs)
        else:
            trees = draft_trees(self.options.tree, roots, pools, self.round_budget,
                                **round_inputs)
        self.engine.trees.store(self.tree_slots[:num_reqs], trees)

    def _draw_seeds(self, num_reqs: int) -> torch.Tensor:
        """[num_reqs] int64 seeds of the rows' tree draws: the request's seed and the
        position of the tree's root, which the verification of that tree derives its seed
        from too (``step_seeds`` of the step's prefix lengths). prepare_dflash_inputs
        wrote each block's first mask position, the one after the root, into sample_pos."""
        depth = self.num_speculative_steps
        root_positions = self.sample_pos[: num_reqs * depth : depth] - 1
        return step_seeds(self.round_seeds[:num_reqs], root_positions)

    def _sampled_rows(self, input_batch, dummy_run: bool) -> np.ndarray:
        """[num_reqs] bool on the host: the batch row's next tree is sampled (the ``verify``
        rule over V2's per-slot temperatures); none in a dummy run."""
        num_reqs = input_batch.num_reqs
        if dummy_run or not self.draws_trees:
            return np.zeros(num_reqs, dtype=bool)
        slots = input_batch.idx_mapping_np[:num_reqs]
        return sampled_tree_rows(self.options, self.engine.temperature[slots])

    def _stage_round(self, slots: torch.Tensor, h_v: torch.Tensor, dummy_run: bool,
                     sampled: np.ndarray, seeds: torch.Tensor) -> None:
        """The round's inputs that come from outside the draft graph, into its buffers;
        ``sampled`` [R] on the host (``_sampled_rows``), ``seeds``: V2's per-slot seeds."""
        num_reqs = slots.shape[0]
        self.tree_slots.fill_(self.max_num_reqs)
        if not dummy_run:  # a dummy run's trees go to the spare slot
            self.tree_slots[:num_reqs] = slots
        if self.h_v is not None:
            self.h_v[:num_reqs] = h_v
        if sampled.any():
            self.round_sampled.zero_()
            self.round_sampled[:num_reqs] = to_device(sampled, self.round_sampled.device)
            self.round_seeds[:num_reqs] = seeds[slots.long()]

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
            last_hidden_states, aux_hidden_states = _in_context_order(
                step.context_order()[: input_batch.num_tokens], last_hidden_states,
                aux_hidden_states)
        else:  # prompt chunks only: each root came from the request's last row
            ends = input_batch.query_start_loc[1 : num_reqs + 1].long() - 1
            h_v = last_hidden_states.index_select(0, ends)
        slots = input_batch.idx_mapping[:num_reqs]
        sampled = self._sampled_rows(input_batch, dummy_run)
        self._stage_round(slots, h_v, dummy_run, sampled, seeds)
        # The step's k from vLLM's batch-size schedule (None: a dummy run, the largest k
        # of the schedule; 0: no drafts this step, vLLM's DFlash then stores the context).
        budget = (self.round_budgets[-1] if num_speculative_tokens is None
                  else num_speculative_tokens)
        # A dummy run drafts the largest round its engine may run: memory profiling sees it.
        self._use_round(budget, self.round_modes[-1] if dummy_run else round_mode(sampled))
        super().propose(input_batch, attn_metadata, slot_mappings, last_hidden_states,
                        aux_hidden_states, num_sampled, num_rejected, last_sampled,
                        next_prefill_tokens, temperature, seeds, *args, dummy_run=dummy_run,
                        num_speculative_tokens=num_speculative_tokens, **kwargs)
        if budget and self.draws_trees and not dummy_run:  # the verifier's flags
            engine.trees.sampled[input_batch.idx_mapping_np[:num_reqs]] = sampled
        return engine.trees.draft_tokens(slots, budget)


def round_budgets(speculative_config, max_num_reqs: int) -> tuple[int, ...]:
    """Every k a step of this engine may draft, ascending: the values of vLLM's own dense
    batch-size lookup (the scheduler's), else num_speculative_tokens alone."""
    budget = speculative_config.num_speculative_tokens
    schedule = speculative_config.num_speculative_tokens_per_batch_size
    if schedule is None:
        return (budget,)
    lookup = build_dynamic_sd_schedule_lookup(schedule, max_num_reqs, budget)
    return tuple(sorted(set(lookup[1:])))


def _in_context_order(order: torch.Tensor, last_hidden_states: torch.Tensor,
                      aux_hidden_states: list[torch.Tensor] | None):
    """The target's hidden states as vLLM's DFlash stores the drafter's context from them
    (``_store_hidden_states``, which reads the batch's rows, len(order)), their rows taken
    in ``order``. With aux layers the drafter reads only them, concatenated: they are
    concatenated here and gathered once, vLLM's concatenation of the one tensor left is a
    copy (one gather instead of one per layer, and no permuted copy of the last layer)."""
    count = order.shape[0]
    if aux_hidden_states:
        rows = torch.cat([h[:count] for h in aux_hidden_states], dim=-1)
        return last_hidden_states, [rows.index_select(0, order)]
    return last_hidden_states[:count].index_select(0, order), aux_hidden_states
