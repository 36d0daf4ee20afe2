"""Tree verification inside vLLM's sampling step.

Replaces the chain rejection sampler for a step that scored draft trees:
the target's logits of every node go through the request-level processing
vLLM's chain sampler applies to draft positions (presence / frequency /
repetition penalties, allowed token ids, bad words, min_tokens), each node
seeing the request's output followed by its own root-to-node path, then
through vLLM's own temperature / top-k / top-p processing; the drafting
core's verifiers accept one root-to-node path plus a bonus token per request.
Greedy requests always use the greedy verifier on deterministic trees (their
target distribution is a point mass). Sampled requests (temperature > 0), per
request in the same batch (:func:`sampled_tree_requests`): "traversal" drafts
trees whose children are sampled and verifies them by traversal; "target_only"
drafts deterministic trees and verifies them target-only; "auto" picks the pair
with the higher measured acceptance (BENCHMARKS.md, "Sampled trees"): sampled
tree + traversal at temperatures from the tree kind's
``options.AUTO_SAMPLED_TREE_MIN_TEMPERATURE`` (weaver 0.75, ddtree any), else the
deterministic tree + target-only, which is optimal among verifiers of a
deterministic tree (always for chain, which has no sampled form).
``sample_roots`` is the fallback that trusts no tree: vLLM's own sampler at
every root, i.e. one step of plain decoding.

Structured outputs: before this step vLLM's ``apply_grammar_bitmask`` has masked
the logits row of every node of a structured request with the grammar state of
that node's own path (``grammar.py`` fills the rows), so every verifier here
accepts only grammar-allowed tokens and samples the constrained distribution.

Thinking budgets: after the request-level processing, each node's row is forced
the way plain decoding forces it after that node's path (``thinking.py``), before
temperature, as vLLM's sampler forces after penalties; ``sample_roots`` goes
through vLLM's sampler, whose holder forces the roots.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
from vllm.v1.sample.ops.bad_words import apply_bad_words
from vllm.v1.sample.ops.penalties import apply_all_penalties
from vllm.v1.sample.rejection_sampler import apply_sampling_constraints

from vllm_tfm.drafting.tree import DraftTree
from vllm_tfm.drafting.verifiers import (
    VerifyResult,
    verify_greedy,
    verify_target_only,
    verify_traversal,
)
from vllm_tfm.options import AUTO_SAMPLED_TREE_MIN_TEMPERATURE, SAMPLED_TREE_KINDS, TfmOptions
from vllm_tfm.vllm_glue.thinking import tree_holder
from vllm_tfm.vllm_glue.tree_step import to_device

_GREEDY_TEMPERATURE_EPS = 1e-5


def node_logits(logits: torch.Tensor, ends: torch.Tensor, num_nodes: torch.Tensor,
                width: int, full: bool = False) -> torch.Tensor:
    """[R, width, V] logits of each node, in ``logits``' dtype: request r's rows
    ends[r] - n_r + j, zeros past its n_r nodes (``width`` is the trees' N, which every
    tree of a step may leave partly empty: a grammar prunes them, a frontier runs dry).
    ``full``: every request scores ``width`` rows back to back (a uniform decode batch,
    host-known), so the result is ``logits`` itself viewed by node, no copy. Consumers
    convert what they need: greedy verification takes the argmax of the bf16 rows as they
    are (the float32 copy of 32 requests of 17 nodes over a 248k vocabulary is 540 MB)."""
    vocab = logits.shape[-1]
    if full:
        return logits.view(-1, width, vocab)
    ends = ends.to(logits.device).long()
    count = num_nodes.to(logits.device).long()
    node = torch.arange(width, device=logits.device)
    rows = (ends - count).view(-1, 1) + node
    valid = node < count.view(-1, 1)
    # A fill, not a product: a grammar-masked row holds -inf, and -inf * 0 is NaN. In place
    # on the gathered copy: one [R, width, V] tensor, not two (a mixed prefill + decode step
    # at batch 32 ran an H100 out of memory here).
    return logits[torch.where(valid, rows, 0)].masked_fill_(~valid[..., None], 0)


def _node_histories(output_token_ids: list[list[int]], tree: DraftTree) -> list[list[int]]:
    """Per node, row-major over [R, N]: the tokens its logits condition on past the
    prompt, i.e. the request's output (whose last token is the root) followed by the
    drafted tokens on the node's path below the root. Padding nodes get the output."""
    rows, width = tree.tokens.shape
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    depths, counts = tree.depths.tolist(), tree.num_nodes.tolist()
    histories = []
    for r in range(rows):
        paths: list[list[int]] = [[] for _ in range(width)]
        for j in sorted(range(1, counts[r]), key=depths[r].__getitem__):
            paths[j] = paths[parents[r][j]] + [tokens[r][j]]
        output = list(output_token_ids[r])
        histories.extend(output + path for path in paths)
    return histories


def _min_tokens_state(sampling) -> dict:
    for processor in sampling.logitsprocs.non_argmax_invariant:
        if isinstance(processor, MinTokensLogitsProcessor):
            return processor.min_toks
    return {}


def apply_request_processing(node_logits: torch.Tensor, tree: DraftTree, sampling) -> torch.Tensor:
    """[R, N, V] node logits after the request-level processing of vLLM's samplers.

    Penalties count the output plus the node's path (as the chain sampler counts
    the output plus the preceding drafts); min_tokens keeps stop tokens out while
    the output plus the node's depth is shorter than min_tokens. logit_bias and
    min_p are refused by vLLM for any speculative method.
    """
    rows, width, vocab = node_logits.shape
    min_tokens = {r: state for r, state in _min_tokens_state(sampling).items() if r < rows}
    bad_words = {r: words for r, words in sampling.bad_words_token_ids.items() if r < rows}
    mask = sampling.allowed_token_ids_mask
    if sampling.no_penalties and not bad_words and not min_tokens and mask is None:
        return node_logits
    flat = node_logits.reshape(rows * width, vocab).clone()
    owner = torch.arange(rows, device=flat.device).repeat_interleave(width)
    if not sampling.no_penalties or bad_words:
        histories = _node_histories(sampling.output_token_ids, tree)
    if not sampling.no_penalties:
        flat = apply_all_penalties(
            flat, sampling.prompt_token_ids[owner], sampling.presence_penalties[owner],
            sampling.frequency_penalties[owner], sampling.repetition_penalties[owner],
            histories,
        )
    if mask is not None:
        flat.masked_fill_(mask[owner], float("-inf"))
    if bad_words:
        apply_bad_words(flat, {r * width + j: words for r, words in bad_words.items()
                               for j in range(width)}, histories)
    if min_tokens:
        depths = tree.depths.to(flat.device)
        for r, (minimum, output, stop_ids, _) in min_tokens.items():
            short = (len(output) + depths[r] < minimum).nonzero()[:, 0]
            if stop_ids and short.numel():
                stops = torch.tensor(sorted(stop_ids), device=flat.device)
                flat[(r * width + short)[:, None], stops] = float("-inf")
    return flat.view(rows, width, vocab)


def greedy_requests(input_batch, num_reqs: int) -> np.ndarray:
    """[R] bool: the request decodes greedily (temperature 0), from V1's host copy of the
    temperatures."""
    return input_batch.temperature_cpu[:num_reqs] < _GREEDY_TEMPERATURE_EPS


def draws_sampled_trees(options: TfmOptions) -> bool:
    """Whether ``options`` give any request a tree whose children are sampled."""
    return options.verify in ("auto", "traversal") and options.tree in SAMPLED_TREE_KINDS


def sampled_tree_rows(options: TfmOptions, temperature: np.ndarray) -> np.ndarray:
    """[R] bool on the host, per request of temperature ``temperature[r]``: draft a tree
    whose children are sampled (verified by traversal).

    True, when the tree kind has a sampled form, for the sampled requests
    (temperature > 0) under ``verify`` "traversal", and for those at the tree
    kind's ``AUTO_SAMPLED_TREE_MIN_TEMPERATURE`` or above under "auto"; greedy
    requests and "target_only" / "greedy" keep deterministic trees.
    """
    if not draws_sampled_trees(options):
        return np.zeros(temperature.shape, dtype=bool)
    lowest = _GREEDY_TEMPERATURE_EPS
    if options.verify == "auto":
        lowest = max(lowest, AUTO_SAMPLED_TREE_MIN_TEMPERATURE[options.tree])
    return temperature >= lowest


def sampled_tree_requests(options: TfmOptions, sampling, num_reqs: int) -> list[bool]:
    """``sampled_tree_rows`` of V1's batch (``sampling``: its SamplingMetadata)."""
    if sampling is None or sampling.all_greedy:
        return [False] * num_reqs
    return sampled_tree_rows(options, sampling.temperature[:num_reqs].cpu().numpy()).tolist()


def verify_option(verify: str, greedy: np.ndarray) -> tuple[np.ndarray, str]:
    """The ``verify`` option applied to a batch whose requests decode greedily where
    ``greedy``: "greedy" verifies every request greedily; the other modes keep greedy
    requests greedy and name how sampled requests' deterministic trees are verified
    (``verify_trees``' ``mode``)."""
    if verify == "greedy":
        return np.ones_like(greedy), "auto"
    return greedy, verify


def request_seeds(sampling_metadata, num_reqs: int, device) -> torch.Tensor:
    """A fresh seed per request and step: drawn from the request's own
    generator when it has a seed (so its output is reproducible whatever the
    batch), else from the global generator."""
    seeds = torch.randint(0, 1 << 62, (num_reqs,), dtype=torch.int64)
    for index, generator in sampling_metadata.generators.items():
        if index < num_reqs:
            seeds[index] = torch.randint(
                0, 1 << 62, (1,), dtype=torch.int64, generator=generator,
                device=generator.device,
            ).cpu()
    return seeds.to(device)


def _merge(chosen: VerifyResult, other: VerifyResult | None, take: np.ndarray) -> VerifyResult:
    """Per request: ``chosen``'s result where ``take`` ([R] bool on the host), else
    ``other``'s (None: no request has one yet)."""
    if other is None or take.all():
        return chosen
    rows = to_device(take, chosen.accepted_leaf.device)
    pick = lambda a, b: torch.where(  # noqa: E731
        rows.view(-1, *([1] * (a.dim() - 1))), a, b
    )
    return VerifyResult(
        accepted_leaf=pick(chosen.accepted_leaf, other.accepted_leaf),
        accepted_len=pick(chosen.accepted_len, other.accepted_len),
        path=pick(chosen.path, other.path),
        bonus_token=pick(chosen.bonus_token, other.bonus_token),
        output_tokens=pick(chosen.output_tokens, other.output_tokens),
    )


# Bytes of the temporary a softmax written back in place makes at a time.
SOFTMAX_CHUNK_BYTES = 256 << 20


def softmax_in_place(x: torch.Tensor) -> torch.Tensor:
    """``x`` (contiguous float32) replaced by its softmax over the last dim, a few hundred
    rows at a time: the same values as ``torch.softmax`` (row by row), without a second
    [rows, V] tensor (1.9 GiB for 32 trees of 65 nodes over a 248k vocabulary). The caller
    checks the dtype and layout (``TreeRejectionSampler``)."""
    rows = x.view(-1, x.shape[-1])
    for chunk in rows.split(max(1, SOFTMAX_CHUNK_BYTES // (4 * rows.shape[1]))):
        chunk.copy_(torch.softmax(chunk, dim=-1))
    return x


def verify_trees(
    tree: DraftTree, logits: torch.Tensor, processed: torch.Tensor, greedy: np.ndarray,
    sampled_tree: np.ndarray, seeds: torch.Tensor, mode: str, *, scratch: bool = False,
) -> VerifyResult:
    """Accept one path per request.

    The verifiers are chosen from host state and read nothing back from the device: a
    batch verifies without a host sync.

    Args:
        logits: [R, N, V] target logits per node after the request-level
            processing; processed: the same after temperature / top-k / top-p;
            greedy: [R] bool on the host, the request decodes greedily;
            sampled_tree: [R] bool on the host, the request's tree has sampled
            children (traversal verifies it; the other sampled requests take
            ``mode``'s deterministic-tree verifier: traversal for "traversal", else
            target-only, whose outcome law traversal only equals there, at a higher
            cost).
        scratch: ``processed`` is a float32 tensor the caller reads no more: its rows
            become the probabilities in place (``softmax_in_place``).
    """
    if greedy.all():
        return verify_greedy(tree, logits, validate=False)
    # Greedy, sampled-tree and deterministic-tree rows partition the batch; each verifier
    # runs only where it has rows.
    result = verify_greedy(tree, logits, validate=False) if greedy.any() else None
    probs = softmax_in_place(processed) if scratch else torch.softmax(processed.float(), dim=-1)
    sampled_tree = sampled_tree & ~greedy
    if sampled_tree.any():
        traversal = verify_traversal(tree, probs, seeds, validate=False)
        result = _merge(traversal, result, sampled_tree)
    deterministic = ~greedy & ~sampled_tree
    if deterministic.any():
        # A batch holding sampled trees carries proposals on every row; these rows' trees
        # are deterministic and are verified as such.
        plain = dataclasses.replace(tree, pool_ids=None, proposal_logq=None)
        if mode == "traversal":
            verified = verify_traversal(plain, probs, seeds, validate=False)
        else:
            verified = verify_target_only(plain, probs, seeds, validate=False)
        result = _merge(verified, result, deterministic)
    return result


def verify_step(runner, step, logits: torch.Tensor, spec_metadata) -> SamplerOutput:
    options = runner._tfm_options
    sampling = runner.input_batch.sampling_metadata
    num_reqs = len(step.req_ids)
    num_nodes = step.meta.num_nodes
    verified = num_nodes if step.void is None else torch.where(step.void, 1, num_nodes)
    tree = runner.drafter.scheduled_trees(step.req_ids, verified)
    raw = logits.float()
    scored = apply_request_processing(
        node_logits(raw, spec_metadata.cu_num_sampled_tokens, num_nodes, tree.tokens.shape[1]),
        tree, sampling)
    budgets = tree_holder(sampling)
    if budgets is not None:
        scored = budgets.force_tree_rows(scored, tree)
    greedy = greedy_requests(runner.input_batch, num_reqs)
    processed = scored
    if not sampling.all_greedy:
        width = scored.shape[1]
        # Every request owns `width` consecutive rows of the flattened node logits.
        cu_rows = width * torch.arange(1, num_reqs + 1, dtype=torch.int32, device=raw.device)
        processed = apply_sampling_constraints(
            scored.flatten(0, 1).clone(), cu_rows, sampling
        ).view_as(scored)
    greedy, mode = verify_option(options.verify, greedy)
    seeds = request_seeds(sampling, num_reqs, raw.device)
    sampled_tree = runner.drafter.scheduled_sampled(step.req_ids)
    result = verify_trees(tree, scored, processed, greedy, sampled_tree, seeds, mode)
    step.accepted_leaf = result.accepted_leaf
    width = spec_metadata.max_spec_len + 1
    sampled = torch.full((num_reqs, width), -1, dtype=torch.int32, device=raw.device)
    tokens = result.output_tokens[:, :width]
    sampled[:, : tokens.shape[1]] = tokens.to(torch.int32)
    logprobs = None
    if sampling.max_num_logprobs is not None:
        logprobs = _path_logprobs(runner.sampler, raw, spec_metadata, num_nodes, result.path,
                                  sampled, sampling.max_num_logprobs)
    return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs)


def sample_roots(runner, step, logits: torch.Tensor, spec_metadata) -> SamplerOutput:
    """No draft accepted anywhere: each request's token is vLLM's own sample at its
    root, the next token of plain decoding (the verifiers' fallback, which trusts
    nothing of the trees)."""
    sampling = runner.input_batch.sampling_metadata
    num_reqs = len(step.req_ids)
    num_nodes = step.meta.num_nodes
    roots = (spec_metadata.cu_num_sampled_tokens.to(logits.device).long()
             - num_nodes.to(logits.device).long())
    plain = dataclasses.replace(sampling, max_num_logprobs=None)  # logprobs: below
    root_output = runner.sampler(logits=logits[roots], sampling_metadata=plain)
    step.accepted_leaf = torch.zeros(num_reqs, dtype=torch.int64, device=logits.device)
    width = spec_metadata.max_spec_len + 1
    sampled = torch.full((num_reqs, width), -1, dtype=torch.int32, device=logits.device)
    sampled[:, :1] = root_output.sampled_token_ids.view(num_reqs, 1).to(torch.int32)
    logprobs = None
    if sampling.max_num_logprobs is not None:
        root_paths = torch.zeros(num_reqs, 1, dtype=torch.long, device=logits.device)
        logprobs = _path_logprobs(runner.sampler, logits.float(), spec_metadata, num_nodes,
                                  root_paths, sampled, sampling.max_num_logprobs)
    return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs)


def _path_logprobs(sampler, raw: torch.Tensor, spec_metadata, num_nodes, path, sampled,
                   max_num_logprobs: int):
    """Logprobs of every output token: token k of a request comes from the
    target's distribution at its k-th path node (rows past the path are
    placeholders that vLLM drops with the -1 tokens)."""
    num_reqs, width = sampled.shape
    ends = spec_metadata.cu_num_sampled_tokens.to(raw.device).long()
    starts = ends - num_nodes.to(raw.device).long()
    nodes = torch.zeros(num_reqs, width, dtype=torch.long, device=raw.device)
    depth = min(width, path.shape[1])
    nodes[:, :depth] = path[:, :depth].clamp(min=0)
    rows = (starts.view(-1, 1) + nodes).flatten()
    tokens = sampled.flatten().long().clamp(min=0)
    return sampler.gather_logprobs(sampler.compute_logprobs(raw[rows]), max_num_logprobs, tokens)
