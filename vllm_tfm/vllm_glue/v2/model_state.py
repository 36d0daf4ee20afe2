"""The V2 tree step around the target forward: :class:`TreeModelState`.

A MambaHybridModelState (the state V2 picks for hybrids) whose hooks run the tree step:

- ``prepare_attn`` (after V2 wrote the linear positions and slot mappings, before the
  forward): builds the batch's :class:`~vllm_tfm.vllm_glue.tree_step.TreeStep` from the
  slots' trees, moves RoPE positions to prefix + depth in place and, for a FULL replay,
  copies the trees into the buffers the captured graph reads (``tree_graphs``); during a
  FULL capture of uniform decodes it activates the fixed-buffer capture step instead, so
  the graph holds the tree kernels (one capture step per query length 1 + k of the
  batch-size schedule, ``graphed_steps_by_length``); a batch whose decodes carry no
  drafts, which V2 still runs as GDN spec rows, gets a step of one-node trees;
- ``custom_sampler``: :class:`TreeRejectionSampler` replaces the chain rejection sampler
  (V2's sampling processing per node, tree verification, logprobs along the path); the
  sampler's per-slot host temperatures go to the engine record, where the speculator reads
  which requests' next trees are sampled;
- ``postprocess_state`` (after sampling): commits the accepted paths (KV rows, GDN and
  conv states; a step that replayed a FULL graph through that graph's buffers, captured
  as a CUDA graph of its own per (size, request count), ``GraphedTreeSteps.commit``),
  restores the linear positions the drafter reads and pins
  ``num_accepted_tokens`` to 1 (the committed state is in slot 0);
- ``add_request``: a new request's slot holds no tree until it drafts one.
"""

from __future__ import annotations

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.config.model import PROCESSED_LOGPROBS_MODES
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
from vllm.v1.worker.gpu.metrics.logits import get_num_nans
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

from vllm_tfm.vllm_glue.commit import (
    attention_layers_by_group,
    commit_gdn_records,
    commit_kv,
    conv_width,
)
from vllm_tfm.vllm_glue.tree_graphs import GraphedTreeSteps
from vllm_tfm.vllm_glue.v2.engine import find_engine
from vllm_tfm.vllm_glue.v2.node_processing import check_processors, process_node_rows
from vllm_tfm.vllm_glue.v2.speculator import round_budgets
from vllm_tfm.vllm_glue.v2.trees import (
    apply_tree_positions,
    batch_tree_step,
    restore_linear_positions,
)
from vllm_tfm.vllm_glue.v2.verify import (
    path_logprobs,
    sampled_tokens,
    step_seeds,
    verify_batch,
)
from vllm_tfm.vllm_glue.verify import node_logits


class TreeModelState(MambaHybridModelState):
    def __init__(self, vllm_config, model, encoder_cache, device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        self.context = vllm_config.compilation_config.static_forward_context
        self.engine = find_engine(self.context)
        speculative = vllm_config.speculative_config
        # Trees of the largest budget: what SlotTrees and the sampled token rows hold.
        self.num_nodes = 1 + speculative.num_speculative_tokens
        self.conv_width = conv_width(vllm_config.model_config)
        self.graphs = graphed_steps_by_length(
            round_budgets(speculative, vllm_config.scheduler_config.max_num_seqs),
            self.conv_width, device)
        self._positions: torch.Tensor | None = None
        # V2's persistent forward block tables (BlockTables.input_block_tables): each
        # step's gather writes its rows there from row 0, in batch order, and nothing
        # rewrites them before postprocess_state, so a commit graph over them reads the
        # tables of every step that replays it.
        self._input_block_tables: list[torch.Tensor] = []
        self._kv_cache_config = None
        self._attention_groups: list[tuple[int, list[str]]] | None = None

    def initialize_kv_cache(self, kv_cache_config, block_tables) -> None:
        super().initialize_kv_cache(kv_cache_config, block_tables)
        # vLLM's memory profiling initialises a throwaway cache first: the last call holds.
        self._input_block_tables = block_tables.input_block_tables
        self._kv_cache_config = kv_cache_config
        self._attention_groups = None

    def add_request(self, req_index, new_req_data) -> None:
        super().add_request(req_index, new_req_data)
        # The slot's tree was drafted for the request that held it before.
        self.engine.trees.clear(req_index)

    def prepare_attn(self, input_batch, cudagraph_mode, block_tables, slot_mappings,
                     attn_groups, kv_cache_config, for_capture=False, ubatch_idx=0,
                     model_specific_attn_metadata=None):
        engine = self.engine
        engine.step = None
        engine.slot.step = None
        if for_capture:
            engine.slot.step = self._capture_step(input_batch)
        else:
            step = batch_tree_step(input_batch, engine.trees, self.conv_width)
            if step is not None:
                apply_tree_positions(input_batch.positions, step)
                if cudagraph_mode == CUDAGraphMode.FULL:
                    self._bind_graph(step, input_batch.num_reqs_after_padding)
                self._run_step(step, input_batch.positions)
        attn_metadata = super().prepare_attn(
            input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups,
            kv_cache_config, for_capture=for_capture, ubatch_idx=ubatch_idx,
            model_specific_attn_metadata=model_specific_attn_metadata)
        if engine.slot.step is None and has_gdn_spec_rows(attn_metadata):
            # V2 runs decodes without drafts as GDN spec rows (only that path applies the
            # last step's accepted offset), and our GDN states keep no draft columns for
            # vLLM's chain kernels: a step of one-node trees, each accepted at its root.
            step = batch_tree_step(input_batch, engine.trees, self.conv_width, draftless=True)
            step.accepted_leaf = torch.zeros(input_batch.num_reqs, dtype=torch.int64,
                                             device=self.device)
            self._run_step(step, input_batch.positions)
        return attn_metadata

    def _run_step(self, step, positions: torch.Tensor) -> None:
        """Make ``step`` this forward's tree step (the layers read it from the slot) and
        the one ``postprocess_state`` commits."""
        self.engine.step = step
        self.engine.slot.step = step
        self._positions = positions

    def _capture_step(self, input_batch):
        """The step a FULL capture runs with: uniform decodes of 1 + k nodes each, k one
        of the schedule's budgets."""
        graphs = self.graphs.get(input_batch.max_query_len)
        if graphs is None:
            raise RuntimeError(
                "dflash_tfm on model runner V2 captures FULL graphs of uniform tree "
                f"decodes only (query lengths {sorted(self.graphs)}), got a FULL capture "
                f"of query length {input_batch.max_query_len}: use "
                "compilation_config cudagraph_mode 'FULL_DECODE_ONLY'")
        return graphs.for_capture(input_batch.num_tokens_after_padding)

    def _bind_graph(self, step, num_reqs_padded: int) -> None:
        num_nodes = step.meta.parents.shape[1]
        graphs = self.graphs.get(num_nodes)
        if graphs is None or num_reqs_padded not in graphs.steps or not step.only_tree_rows:
            captured = {n: sorted(g.steps) for n, g in self.graphs.items()}
            raise RuntimeError(
                f"dflash_tfm: model runner V2 replays a FULL graph of {num_reqs_padded} "
                f"requests of {num_nodes} nodes that was not captured with a tree step "
                f"(captured request counts by node count: {captured})")
        graphs.bind(step, num_reqs_padded)

    def capture_inner_cudagraphs(self, *args, **kwargs) -> None:
        # The target's graphs are captured: the drafter's capture comes next, and its
        # attention layers must not see the last capture step.
        self.engine.slot.step = None
        super().capture_inner_cudagraphs(*args, **kwargs)

    def custom_sampler(self, sampler):
        self.engine.temperature = sampler.sampling_states.temperature.np
        return sampler, TreeRejectionSampler(self, sampler)

    def postprocess_state(self, idx_mapping, num_sampled, num_computed_tokens=None) -> None:
        engine = self.engine
        engine.slot.step = None
        step = engine.step
        if step is not None and step.accepted_leaf is not None:
            self._commit(step)
            restore_linear_positions(self._positions, step)
        # Slot 0 and the first conv columns hold the committed state (vLLM's readers
        # resume from slot num_accepted - 1).
        super().postprocess_state(idx_mapping, 1, num_computed_tokens)

    def _commit(self, step) -> None:
        if step.graph_size is None:
            self._commit_caches(step)
        else:  # a step that replayed a FULL graph commits through that graph's buffers
            self.graphs[step.meta.max_nodes].commit(step, self._commit_caches)
        step.gdn_records = {}

    def _commit_caches(self, step) -> None:
        """Advance the caches of ``step``'s requests along their accepted paths."""
        if self._attention_groups is None:  # the target's attention layers, found once
            self._attention_groups = attention_layers_by_group(
                self._kv_cache_config, self.context, self.engine.draft_layer_names)
        num_reqs = len(step.req_ids)
        commit_kv(self.context, self._attention_groups,
                  lambda gid: self._input_block_tables[gid][:num_reqs], step)
        commit_gdn_records(step.gdn_records.values(), step.accepted_leaf)


def has_gdn_spec_rows(attn_metadata: dict) -> bool:
    """Some GDN layer's metadata of this forward runs rows on vLLM's speculative path."""
    return any(isinstance(metadata, GDNAttentionMetadata)
               and metadata.spec_sequence_masks is not None
               for metadata in attn_metadata.values())


def graphed_steps_by_length(budgets: tuple[int, ...], conv_width: int,
                            device: torch.device) -> dict[int, GraphedTreeSteps]:
    """By query length 1 + k, for every k a step may draft: the fixed-buffer tree steps
    of that k (V2 captures a uniform decode graph of each query length of the batch-size
    schedule, ``cudagraph_utils._init_candidates``)."""
    return {1 + k: GraphedTreeSteps(1 + k, conv_width, device) for k in budgets}


# Bytes of float32 node rows (processing, probabilities, logprobs) a verification pass
# holds at a time: a batch past it is verified a group of requests at a time. V2's warm-up
# verifies max_num_batched_tokens // (2 + k) requests of 1 + k rows, which our budget rule
# never schedules (252 x 65 rows at the LLM class's 16384 tokens: 16 GB of float32 copies
# over a 248k vocabulary, beyond what vLLM's memory profile of one row per request left).
VERIFY_CHUNK_BYTES = 1 << 30


def request_chunks(num_reqs: int, width: int, vocab: int) -> list[slice]:
    """Consecutive groups of requests whose [requests, width, vocab] float32 rows fit
    ``VERIFY_CHUNK_BYTES`` (at least one request a group)."""
    size = max(1, VERIFY_CHUNK_BYTES // (4 * width * vocab))
    return [slice(first, min(first + size, num_reqs)) for first in range(0, num_reqs, size)]


def joined(parts):
    """Per-group tensors as the batch's: the one group's as they are (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class TreeRejectionSampler:
    """V2's rejection-sampler seam (``sampler(logits, input_batch, draft_logits,
    invalid_drafts) -> SamplerOutput``), verifying the step's trees: every node row through
    V2's sampling processing over its own path (``node_processing``), then the tree
    verifiers, then logprobs along the accepted path; a group of requests at a time
    (``request_chunks``), so a batch's float32 copies stay bounded."""

    # V2's warm-up switches adaptive verification off and back on; trees have none.
    enable_adaptive_verification = False

    def __init__(self, state: TreeModelState, sampler) -> None:
        check_processors(sampler)
        self.state = state
        self.sampler = sampler

    def __call__(self, logits, input_batch, draft_logits=None, invalid_drafts=None):
        state, sampler = self.state, self.sampler
        step = state.engine.step
        if step is None:
            raise RuntimeError("dflash_tfm: V2 verifies drafts of a step without a tree")
        num_nans = get_num_nans(logits) if sampler.compute_nans else None
        num_reqs = input_batch.num_reqs
        slots = input_batch.idx_mapping[:num_reqs]
        slots_np = input_batch.idx_mapping_np[:num_reqs]
        trees = state.engine.trees
        sampled_tree = trees.sampled_rows(slots_np)
        tree = trees.gather(slots, draws=bool(sampled_tree.any()), num_nodes=step.meta.num_nodes)
        sampling = sampler.sampling_states
        num_logprobs = sampling.max_num_logprobs(slots_np)
        seeds = step_seeds(sampling.seeds.gpu[slots], step.prefix_lens)
        groups = request_chunks(num_reqs, tree.max_nodes, logits.shape[-1])
        chunks = [self._verify_requests(
            rows, logits, input_batch,
            tree if len(groups) == 1 else tree.select(torch.arange(rows.start, rows.stop)),
            sampled_tree[rows], seeds[rows], num_logprobs) for rows in groups]
        results, sampled, num_sampled, num_rejected, logprobs = zip(*chunks)
        step.accepted_leaf = joined([result.accepted_leaf for result in results])
        if num_logprobs == NO_LOGPROBS:
            logprobs = None
        elif len(chunks) == 1:
            logprobs = logprobs[0]
        else:
            expanded = int(input_batch.cu_num_logits_np[num_reqs]) != num_reqs
            logprobs = LogprobsTensors(
                *(torch.cat(parts) for parts in zip(*(part[:3] for part in logprobs))),
                cu_num_generated_tokens=(input_batch.cu_num_logits_np[: num_reqs + 1].tolist()
                                         if expanded else None))
        return SamplerOutput(
            sampled_token_ids=joined(sampled), logprobs_tensors=logprobs, num_nans=num_nans,
            num_sampled=joined(num_sampled), num_rejected=joined(num_rejected))

    def _verify_requests(self, rows: slice, logits, input_batch, tree, sampled_tree, seeds,
                         num_logprobs):
        """(result, sampled tokens, num_sampled, num_rejected, logprobs or None) of the
        batch's requests ``rows``, whose trees are ``tree``, sampled where ``sampled_tree``,
        seeded by ``seeds``."""
        state, sampler = self.state, self.sampler
        step = state.engine.step
        slots = input_batch.idx_mapping[rows]
        slots_np = input_batch.idx_mapping_np[rows]
        width = tree.max_nodes
        # The requests' own logits rows, and their ends counted from the first of them.
        cu_num_logits = input_batch.cu_num_logits[rows.start : rows.stop + 1]
        cu_np = input_batch.cu_num_logits_np[rows.start : rows.stop + 1]
        first_row = int(cu_np[0])
        if first_row:
            cu_num_logits, cu_np = cu_num_logits - cu_num_logits[0], cu_np - first_row
        own_rows = logits[first_row : first_row + int(cu_np[-1])]
        raw = node_logits(own_rows, cu_num_logits[1:], step.meta.num_nodes[rows], width,
                          full=bool((step.num_nodes_host[rows] == width).all()))
        processed = process_node_rows(
            sampler, raw.flatten(0, 1), tree, step.prefix_lens[rows], slots, slots_np
        ).view_as(raw)
        sampling = sampler.sampling_states
        mode = sampler.logprobs_mode
        # process_node_rows' own float32 copy (not the logits) may become the
        # probabilities, unless the logprobs below read it.
        own_copy = processed.untyped_storage().data_ptr() != raw.untyped_storage().data_ptr()
        scratch = (own_copy and processed.dtype == torch.float32 and processed.is_contiguous()
                   and (num_logprobs == NO_LOGPROBS or mode not in PROCESSED_LOGPROBS_MODES))
        result = verify_batch(tree, processed, sampling.temperature.np[slots_np], sampled_tree,
                              seeds, state.engine.verify, scratch)
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            (result.accepted_len + 1).to(torch.int32), input_batch.seq_lens[rows],
            cu_num_logits, slots, sampler.req_states.prefill_len.gpu)
        sampled = sampled_tokens(result, state.num_nodes)
        logprobs = None
        if num_logprobs != NO_LOGPROBS:
            scored = processed if mode in PROCESSED_LOGPROBS_MODES else raw
            logprobs = path_logprobs(
                scored, result.path, sampled, num_sampled, cu_num_logits, cu_np, num_logprobs,
                logits_mode=mode in ("raw_logits", "processed_logits"))
        return result, sampled, num_sampled, num_rejected, logprobs
