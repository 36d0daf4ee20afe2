"""Model-runner (V1) hooks: tree inputs, tree verification, commit, proposer swap.

Every wrapper is a no-op unless the runner's VllmConfig runs dflash_tfm.
The order within one engine step is:

    _prepare_inputs   -> TreeStep built, RoPE positions = prefix + depth, activated
    _determine_batch_execution_and_padding -> a uniform batch of full trees replays
                         vLLM's FULL graph of its size (captured with a tree step,
                         tree_graphs.py); any other step with trees runs eagerly
    (target forward)  -> attention / GDN patches read the active TreeStep
    _sample           -> tree verifier: accepted path + bonus per request
    _update_states... -> commit the accepted path (KV, GDN, conv); deactivate
    propose_draft...  -> the tree proposer drafts the next trees
    take_draft_token_ids -> the drafts vLLM schedules next

Faults of the tree path never cost a wrong token, and cost the engine only where
nothing safe is left:

    drafting fails          -> the batch drafts nothing this step (plain decoding)
    a request's tree is lost -> its drafts are scored but not verified (the root's
                               token is exact) and it never drafts again
    verification fails      -> every request gets vLLM's own sample at its root
    the commit fails        -> the caches it was writing are unknown: those requests
                               end with FinishReason.ERROR (HTTP 500), through the
                               scheduler hook below; the others carry on
    the target forward fails -> raised, as vLLM does for its own kernels

vLLM 0.32's runner has no way to fail one request: ModelRunnerOutput carries no
per-request error, and the scheduler finishes requests with FINISHED_ERROR only for
its own causes (grammar compilation, encoder-cache mismatch, KV-connector load
failures). `wrap_sample_tokens` hands the failed requests over on the runner's
output and `wrap_scheduler_update_from_output` finishes them as vLLM finishes those.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import torch
from vllm.distributed import get_tp_group
from vllm.config import CUDAGraphMode
from vllm.logger import init_logger

from vllm_tfm.vllm_glue.commit import conv_width
from vllm_tfm.vllm_glue.config import tfm_options
from vllm_tfm.vllm_glue.grammar import attach_tree_parents
from vllm_tfm.vllm_glue.tree_graphs import (
    GraphedTreeSteps,
    budget_rule_for_graphs,
    graphable,
)
from vllm_tfm.vllm_glue.tree_step import (
    TreeStep,
    build_tree_step,
    install_step_slot,
    to_device,
    tree_position_shifts,
)

logger = init_logger(__name__)

# The attribute of a ModelRunnerOutput that lists the requests the runner failed.
FAILED_REQUESTS = "tfm_failed_req_ids"


def _enabled(runner) -> bool:
    return getattr(runner, "_tfm_options", None) is not None


def _report_fault(stage: str, req_ids, consequence: str) -> None:
    """Log a fault of the tree path with its traceback (from an except block)."""
    logger.exception("dflash_tfm: %s failed for requests %s; %s", stage, list(req_ids),
                     consequence)


def wrap_init(original):
    @functools.wraps(original)
    def __init__(self, vllm_config, device, *args, **kwargs):
        original(self, vllm_config, device, *args, **kwargs)
        options = tfm_options(vllm_config)
        if options is None:
            self._tfm_options = None
            return
        full_decode_graphs = (self.device.type == "cuda" and
                              self.compilation_config.cudagraph_mode.decode_mode()
                              == CUDAGraphMode.FULL)
        self._tfm_options = budget_rule_for_graphs(options, full_decode_graphs)
        if self._tfm_options is not options:
            logger.info("dflash_tfm: FULL decode graphs hold trees of %d drafts only: every "
                        "step drafts that budget (set budget_by_batch to choose otherwise)",
                        options.budget)
        from vllm_tfm.vllm_glue.proposer import TreeProposer

        self.drafter = TreeProposer(vllm_config, device, self, self._tfm_options)
        self._tfm_step = None
        # The layers of this engine find the step here (tree_step.active); a target
        # forward that raised leaves its step in this slot only.
        self._tfm_slot = install_step_slot(vllm_config.compilation_config.static_forward_context)
        self._tfm_undrafted: set[str] = set()  # requests that lost a tree: no more drafts
        self._tfm_graphs = GraphedTreeSteps(1 + self.num_spec_tokens,
                                            conv_width(self.model_config),
                                            self.device)
        self._tfm_failed: set[str] = set()  # for the scheduler to finish with an error

    return __init__


def _build_step(runner, scheduler_output, num_scheduled_tokens: np.ndarray, spec_metadata,
                trees_lost: bool = False):
    """The step's TreeStep. A request whose tree cannot be read back from the proposer
    (or every request, with ``trees_lost``) is void: its drafts, already in the batch,
    are scored as a chain and never accepted (see TreeStep.void)."""
    num_reqs = runner.input_batch.num_reqs
    req_ids = list(runner.input_batch.req_ids[:num_reqs])
    num_drafts = np.asarray(spec_metadata.num_draft_tokens, dtype=np.int64)
    num_nodes = num_drafts + 1
    max_nodes = int(num_nodes.max())
    parents = np.full((num_reqs, max_nodes), -1, dtype=np.int64)
    void = np.zeros(num_reqs, dtype=bool)
    proposer = runner.drafter
    for r, req_id in enumerate(req_ids):
        if num_drafts[r] == 0:
            continue
        count = int(num_nodes[r])
        if not trees_lost:
            try:
                parents[r, :count] = proposer.scheduled_parents(req_id, count)
                continue
            except Exception:
                _report_fault("reading its scheduled tree", [req_id],
                              "its drafts are not verified and it drafts no more")
        parents[r, :count] = np.arange(count) - 1
        void[r] = True
    device = runner.device
    return build_tree_step(
        req_ids, to_device(parents, device), num_nodes,
        runner.query_start_loc.np[: num_reqs + 1].astype(np.int64),
        to_device((runner.input_batch.num_computed_tokens_cpu[:num_reqs]
                   + num_scheduled_tokens[:num_reqs]).astype(np.int32), device),
        num_scheduled_tokens[:num_reqs].astype(np.int64), runner.positions,
        conv_width(runner.model_config),
        void=to_device(void, device) if void.any() else None,
    )


def _apply_tree_positions(runner, step: TreeStep) -> None:
    shifts = tree_position_shifts(step)
    if shifts is None:
        return
    rows, shift = shifts
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
            try:
                step = _build_step(self, scheduler_output, num_scheduled_tokens, spec_metadata)
                if step.void is not None:  # trees lost one by one: those requests' fault
                    self._tfm_undrafted.update(
                        req_id for req_id, lost in zip(step.req_ids, step.void.tolist()) if lost
                    )
            except Exception:
                _report_fault("building the tree step", self.input_batch.req_ids,
                              "no draft is verified this step")
                step = _build_step(self, scheduler_output, num_scheduled_tokens, spec_metadata,
                                   trees_lost=True)
            _apply_tree_positions(self, step)
        self._tfm_step = step
        self._tfm_slot.step = step
        return result

    return _prepare_inputs


def wrap_determine_batch_execution_and_padding(original):
    @functools.wraps(original)
    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        step = getattr(self, "_tfm_step", None)
        if not _enabled(self) or step is None or not step.has_trees:
            return original(self, *args, **kwargs)
        graphs = self._tfm_graphs
        # Data parallelism agrees on a graph mode across ranks: a second call would
        # repeat that exchange, so there every tree step runs eagerly.
        if graphable(step, graphs.num_nodes) and self.parallel_config.data_parallel_size == 1:
            result = original(self, *args, **kwargs)
            mode, batch = result[0], result[1]
            num_reqs = batch.num_reqs or batch.num_tokens // graphs.num_nodes
            if mode == CUDAGraphMode.FULL and num_reqs in graphs.steps:
                graphs.bind(step, num_reqs)
                return result
        # Graphs other than the FULL decode graphs captured with a tree step would run
        # the chain kernels over the tree's rows (silently wrong): eager.
        kwargs["force_eager"] = True
        return original(self, *args, **kwargs)

    return _determine_batch_execution_and_padding


def wrap_warmup_and_capture(original):
    """vLLM's warm-up and capture of one graph; a FULL graph of uniform decodes is
    captured with a tree step of its size active, so that it holds the tree path."""

    @functools.wraps(original)
    def _warmup_and_capture(self, desc, cudagraph_runtime_mode, *args, **kwargs):
        if not (_enabled(self) and desc.uniform and cudagraph_runtime_mode == CUDAGraphMode.FULL):
            return original(self, desc, cudagraph_runtime_mode, *args, **kwargs)
        held, self._tfm_step = self._tfm_step, None
        self._tfm_slot.step = self._tfm_graphs.for_capture(desc.num_tokens)
        try:
            return original(self, desc, cudagraph_runtime_mode, *args, **kwargs)
        finally:
            self._tfm_slot.step = None
            self._tfm_step = held

    return _warmup_and_capture


def wrap_sample(original):
    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        step = getattr(self, "_tfm_step", None)
        if not _enabled(self) or spec_decode_metadata is None or step is None:
            return original(self, logits, spec_decode_metadata)
        if not step.has_trees:
            # No drafts anywhere (e.g. a step of prompts): vLLM's sampler, and
            # every request's root is its accepted leaf.
            step.accepted_leaf = torch.zeros(len(step.req_ids), dtype=torch.int64,
                                             device=step.token_rows.device)
            return original(self, logits, spec_decode_metadata)
        from vllm_tfm.vllm_glue.verify import sample_roots, verify_step

        try:
            output = verify_step(self, step, logits, spec_decode_metadata)
        except Exception:
            _report_fault("tree verification", step.req_ids,
                          "every request takes vLLM's sample at its root this step")
            output = sample_roots(self, step, logits, spec_decode_metadata)
        _adopt_first_rank_result(step, output)
        return output

    return _sample


def _adopt_first_rank_result(step, output) -> None:
    """Under tensor parallelism, every rank takes the first rank's accepted paths.

    Every rank verifies the same (broadcast) trees against the same gathered logits
    with generators vLLM keeps in step, so they agree already; the broadcast keeps
    them agreeing when a fault sent one rank down the fallback, since each rank
    commits its own cache shards along the path it holds.
    """
    group = get_tp_group()
    if group.world_size > 1:
        step.accepted_leaf = step.accepted_leaf.contiguous()  # received in place
        group.broadcast(output.sampled_token_ids, src=0)
        group.broadcast(step.accepted_leaf, src=0)


def wrap_update_states_after_model_execute(original):
    @functools.wraps(original)
    def _update_states_after_model_execute(self, output_token_ids, scheduler_output):
        original(self, output_token_ids, scheduler_output)
        if not _enabled(self):
            return
        self._tfm_slot.step = None
        step = self._tfm_step
        if step is None:
            return
        from vllm_tfm.vllm_glue.commit import commit_step, publish_commit, written_requests

        failed = torch.zeros(len(step.req_ids), dtype=torch.int32)
        try:
            if step.graph_size is None:
                commit_step(self, step)
            else:  # a step that replayed a FULL graph commits through that size's buffers
                self._tfm_graphs.commit(step, functools.partial(commit_step, self))
        except Exception:
            written = written_requests(step)
            _report_fault("committing the accepted paths", [step.req_ids[r] for r in written],
                          "their caches are unknown: they end with an error")
            failed[written] = 1
        group = get_tp_group()
        if group.world_size > 1:
            # Only the first rank's output reaches the scheduler: it must fail every
            # request whose cache shard any rank left unknown.
            torch.distributed.all_reduce(failed, group=group.cpu_group)
        self._tfm_failed.update(step.req_ids[r] for r in failed.nonzero()[:, 0].tolist())
        step.gdn_records.clear()
        publish_commit(self, len(step.req_ids))

    return _update_states_after_model_execute


def wrap_propose_draft_token_ids(original):
    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, *args, **kwargs):
        if not _enabled(self):
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata,
                            hidden_states, *args, **kwargs)
        try:
            # Weaver reads the target's final-norm state of each bonus row.
            self.drafter.set_target_hidden_states(hidden_states, self._tfm_step)
            self.drafter.set_step_tokens(sampled_token_ids)
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata,
                            hidden_states, *args, **kwargs)
        except Exception:
            # The step's tokens are verified and committed already; drafts are optional.
            _report_fault("drafting", self.input_batch.req_ids, "no drafts this step")
            self.drafter.take_drafted()
            return [[] for _ in self.input_batch.req_ids]

    return propose_draft_token_ids


def wrap_take_draft_token_ids(original):
    @functools.wraps(original)
    def take_draft_token_ids(self):
        drafts = original(self)
        if drafts is None or not _enabled(self):
            return drafts
        self._tfm_undrafted &= self.requests.keys()
        if not self.drafter.take_drafted():
            # vLLM skipped drafting (a context too close to max_model_len) and
            # left zero placeholders; they form no tree, so schedule none.
            rows = [[] for _ in drafts.draft_token_ids]
        else:
            # Trees smaller than the budget are padded with -1: drop the padding.
            rows = [
                [] if req_id in self._tfm_undrafted else [token for token in row if token >= 0]
                for req_id, row in zip(drafts.req_ids, drafts.draft_token_ids)
            ]
        # A request vLLM left out of this step keeps the drafts it was given before,
        # and the proposer holds the trees of this step's batch only: schedule none.
        drafted = set(drafts.req_ids)
        idle = [req_id for req_id in self.requests if req_id not in drafted]
        result = type(drafts)(list(drafts.req_ids) + idle, rows + [[] for _ in idle])
        # Structured requests: the scheduler masks each node by its own path.
        attach_tree_parents(result, self.drafter, self.requests)
        return result

    return take_draft_token_ids


def wrap_sample_tokens(original):
    @functools.wraps(original)
    def sample_tokens(self, *args, **kwargs):
        output = original(self, *args, **kwargs)
        if not _enabled(self) or not self._tfm_failed:
            return output
        failed, self._tfm_failed = frozenset(self._tfm_failed), set()
        # vLLM may hand out shared output objects: change a copy. None of the failed
        # requests' tokens of this step leaves the runner (the drafter saw them, so its
        # inputs stayed well-formed).
        output = copy.copy(output)
        output.sampled_token_ids = [
            [] if req_id in failed else tokens
            for req_id, tokens in zip(output.req_ids, output.sampled_token_ids)
        ]
        setattr(output, FAILED_REQUESTS, failed)
        return output

    return sample_tokens


def wrap_scheduler_update_from_output(original):
    """Finish the requests a runner failed (`FAILED_REQUESTS`) with FINISHED_ERROR,
    as the scheduler finishes its own request-level errors (update_from_output's
    error_req_ids): the client gets finish_reason "error" (HTTP 500 from the OpenAI
    server) and the engine keeps serving the others."""

    @functools.wraps(original)
    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = original(self, scheduler_output, model_runner_output)
        failed = getattr(model_runner_output, FAILED_REQUESTS, None)
        if not failed:
            return outputs
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
        from vllm.v1.request import RequestStatus

        for request in self.finish_requests(failed, RequestStatus.FINISHED_ERROR):
            client = outputs.setdefault(request.client_index, EngineCoreOutputs())
            client.outputs.append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[],
                finish_reason=request.get_finished_reason(), events=request.take_events(),
                trace_headers=request.trace_headers,
            ))
        return outputs

    return update_from_output
