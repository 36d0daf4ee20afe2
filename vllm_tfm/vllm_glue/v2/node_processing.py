"""Model runner V2's request-level sampling processing, applied to every tree node.

V2's rejection sampler hands its target rows to ``Sampler.apply_sampling_params``: per logits
row, by the row's request slot (``expanded_idx_mapping``), the logits processors (logit bias
with allowed token ids and min_tokens, penalties, bad words), then temperature, min_p and
top-k / top-p. A chain's row at offset p sees the request's committed output followed by
drafts 1..p. A tree node must see the output followed by its own root-to-node path, so
:func:`process_node_rows` runs the same sequence over the node rows with V2's own state and
ops wherever an op reads only the row's slot and position:

- logit bias / allowed token ids / min_tokens (V2's ``LogitBiasState``; its min_tokens test
  reads the row's position, which for a node is prefix + depth), temperature, min_p and
  top-k / top-p (``SamplingStates``): V2's ops, unchanged, over the node rows;
- penalties: V2's kernel with every row at offset 0 (the committed output's counts), then the
  row's path tokens recomputed from their pre-penalty logits with the path counted
  (:func:`_penalise_path_tokens`, the kernel's arithmetic);
- bad words: matched against output + path per node (:func:`_ban_bad_words`, the kernel's
  rule), V2's state.

So the verifier sees at each node exactly the distribution plain decoding samples from after
that node's path. Custom logits processors and thinking budgets read a chain's draft rows and
have no tree form here: the engine refuses them (``verify.refused_sampling_field``,
:func:`check_processors`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from vllm_tfm.drafting.tree import DraftTree


@dataclasses.dataclass(frozen=True)
class NodeRows:
    """The node rows of a V2 tree batch: [R, W] flattened row-major to M = R * W rows."""

    slots: torch.Tensor  # [M] int32 request slot of each row (V2's expanded_idx_mapping)
    positions: torch.Tensor  # [M] int64 position of the row's node: prefix + depth
    tokens: torch.Tensor  # [M] int64 the node's token (the row's input token)
    # [M, D] int64 the drafted tokens on the node's path, newest first (the node itself,
    # its parent, ... up to depth 1), -1 past the node's depth
    paths: torch.Tensor


def path_tokens(tree: DraftTree) -> torch.Tensor:
    """[R, N, D] int64: token of each node's k-th ancestor (k = 0: the node) while that
    ancestor is a drafted node (depth >= 1), -1 beyond; D = ``tree.max_depth``."""
    parents = tree.parents.long().clamp(min=0)
    depths = torch.where(tree.valid, tree.depths.long(), 0)
    node = torch.arange(tree.max_nodes, device=parents.device).expand_as(parents)
    columns = []
    for k in range(tree.max_depth):
        columns.append(torch.where(depths > k, tree.tokens.gather(1, node), -1))
        node = parents.gather(1, node)
    if not columns:
        return tree.tokens.new_full((*tree.tokens.shape, 0), -1)
    return torch.stack(columns, -1)


def node_rows(tree: DraftTree, slots: torch.Tensor, prefix_lens: torch.Tensor) -> NodeRows:
    """The rows of ``tree`` ([R, W]) for requests in ``slots`` [R] whose roots sit at
    positions ``prefix_lens`` [R]."""
    rows, width = tree.tokens.shape
    positions = prefix_lens.long().view(-1, 1) + tree.depths.long()
    return NodeRows(
        slots=slots.to(torch.int32).repeat_interleave(width),
        positions=positions.flatten(),
        tokens=tree.tokens.flatten().long(),
        paths=path_tokens(tree).flatten(0, 1),
    )


def check_processors(sampler) -> None:
    """Raise unless every logits processor of V2's ``sampler`` has a tree form here."""
    from vllm.v1.worker.gpu.sample.bad_words import BadWordsState
    from vllm.v1.worker.gpu.sample.logit_bias import LogitBiasState
    from vllm.v1.worker.gpu.sample.penalties import PenaltiesState

    known = (LogitBiasState, PenaltiesState, BadWordsState)
    others = [type(p).__name__ for p in sampler.logits_processors if not isinstance(p, known)]
    if others:
        raise ValueError(
            "dflash_tfm on model runner V2 applies vLLM's built-in logits processors "
            f"(logit bias, penalties, bad words) to tree nodes, not {others}: drop the "
            "engine's logits_processors or run model runner V1 (VLLM_USE_V2_MODEL_RUNNER=0)")


def process_node_rows(sampler, logits: torch.Tensor, tree: DraftTree, prefix_lens: torch.Tensor,
                      idx_mapping: torch.Tensor, idx_mapping_np: np.ndarray) -> torch.Tensor:
    """[M, V] the node rows ``logits`` of ``tree`` ([R, W], M = R * W; roots at positions
    ``prefix_lens`` [R]) after V2's sampling processing: the same tensor when no request of
    the batch needs any, as V2 returns it (its node rows are then not even built: a
    greedy batch launches nothing here), else a new float32 one.

    ``sampler``: V2's Sampler; ``idx_mapping`` [R] / ``idx_mapping_np`` the batch's slots.
    """
    from vllm.v1.worker.gpu.sample.bad_words import BadWordsState
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext
    from vllm.v1.worker.gpu.sample.penalties import PenaltiesState

    if not np.any(sampler.needs_logits_processing[idx_mapping_np]):
        return logits
    rows = node_rows(tree, idx_mapping, prefix_lens)
    # One float32 copy (.float().clone() of bf16 logits made two: 1.9 GiB each for 32
    # trees of 65 nodes over a 248k vocabulary, V2's warm-up ran out of memory there).
    logits = logits.to(torch.float32, copy=True)
    ctx = LogitsContext(
        expanded_idx_mapping=rows.slots, idx_mapping=idx_mapping,
        idx_mapping_np=idx_mapping_np,
        # Offset 0: V2's path-reading kernels see the committed output only; the path
        # is added below.
        expanded_local_pos=torch.zeros_like(rows.slots), input_ids=rows.tokens,
        pos=rows.positions, seq_lens_upper_bound_np=None)
    for processor in sampler.logits_processors:
        if isinstance(processor, PenaltiesState):
            # V2 decides from its host state whether any request of the batch has one.
            if not np.any(processor.use_penalty[idx_mapping_np]):
                continue
            before = logits.gather(1, rows.paths.clamp(min=0))
            logits = processor.apply(logits, ctx)
            _penalise_path_tokens(logits, before, processor, rows)
        elif isinstance(processor, BadWordsState):
            _ban_bad_words(logits, processor, rows, idx_mapping_np)
        else:  # LogitBiasState (check_processors admits nothing else)
            logits = processor.apply(logits, ctx)
    states = sampler.sampling_states
    states.apply_temperature(logits, rows.slots, idx_mapping_np)
    # vLLM refuses min_p with speculative decoding (SamplingParams._validate_spec_decode);
    # applied as V2 orders it, it is a no-op until that changes.
    states.apply_min_p(logits, rows.slots, idx_mapping_np)
    return states.apply_top_k_top_p(logits, rows.slots, idx_mapping_np)


def _penalise_path_tokens(logits: torch.Tensor, before: torch.Tensor, state,
                          rows: NodeRows) -> None:
    """Recompute, in place, each row's entries at its path tokens from their pre-penalty
    values ``before`` [M, D] with the path counted: V2's penalty kernel's arithmetic with
    count = committed output count + occurrences on the path."""
    paths = rows.paths
    on_path = paths >= 0
    tokens = paths.clamp(min=0)
    slots = rows.slots.long().view(-1, 1)
    repeats = ((tokens[:, :, None] == tokens[:, None, :]) & on_path[:, None, :]).sum(-1)
    counts = state.output_bin_counts[slots, tokens] + repeats
    in_prompt = ((state.prompt_bin_mask[slots, tokens // 32] >> (tokens % 32)) & 1).bool()
    repetition = state.repetition_penalty.gpu[slots]
    scale = torch.where(in_prompt | (counts > 0), repetition, 1.0)
    value = before * torch.where(before > 0, 1.0 / scale, scale)
    value = value - state.frequency_penalty.gpu[slots] * counts
    value = value - state.presence_penalty.gpu[slots] * (counts > 0)
    # One scatter, no mask index (a host sync on CUDA): a token repeated on a path gets
    # the same value at each of its columns, and the columns past the path (paths are
    # newest first) rewrite the node's own token with its value, or with what the row
    # holds already where there is no path (a root).
    has_path = on_path[:, :1]
    columns = torch.where(on_path, tokens, tokens[:, :1])
    own = torch.where(has_path, value[:, :1], logits.gather(1, tokens[:, :1]))
    logits.scatter_(1, columns, torch.where(on_path, value, own))


def _ban_bad_words(logits: torch.Tensor, state, rows: NodeRows,
                   idx_mapping_np: np.ndarray) -> None:
    """V2's bad-words rule per node, in place: a bad word's last token is banned where the
    tokens before it end the node's history (committed output + path)."""
    num_words = int(state.num_bad_words.np[idx_mapping_np].max())
    if num_words == 0:
        return
    requests = state.req_states
    slots = rows.slots.long()
    width = state.bad_word_token_ids.gpu.shape[1]  # no bad word is longer
    depth = (rows.paths >= 0).sum(1, keepdim=True)
    prompt_len = requests.prompt_len.gpu[slots].long().view(-1, 1)
    output_len = requests.total_len.gpu[slots].long().view(-1, 1) - prompt_len
    # history[m, j]: the j-th newest token of row m's history (path first, then output).
    newest = torch.arange(width, device=slots.device).view(1, -1)
    paths = torch.nn.functional.pad(rows.paths, (0, max(0, width - rows.paths.shape[1])),
                                    value=-1)[:, :width]
    output_index = output_len - 1 - (newest - depth)
    output = requests.all_token_ids.gpu[slots.view(-1, 1),
                                        (prompt_len + output_index).clamp(min=0)]
    history = torch.where(newest < depth, paths, torch.where(output_index >= 0, output, -1))
    words = state.bad_word_token_ids.gpu[slots]
    offsets = state.bad_word_offsets.gpu[slots].long()
    count = state.num_bad_words.gpu[slots].long()
    for word in range(num_words):
        start, end = offsets[:, word : word + 1], offsets[:, word + 1 : word + 2]
        prefix = end - start - 1
        expected = words.gather(1, (end - 2 - newest).clamp(min=0)).long()
        matched = ((newest >= prefix) | (expected == history)).all(1)
        matched &= (word < count) & (prefix <= output_len + depth).view(-1)
        last = words.gather(1, (end - 1).clamp(min=0)).long()
        # A scatter over every row (unmatched rows keep their value): no mask index.
        kept = logits.gather(1, last)
        logits.scatter_(1, last, torch.where(matched.view(-1, 1), float("-inf"), kept))
