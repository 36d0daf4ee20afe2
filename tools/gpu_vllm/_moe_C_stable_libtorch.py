# Stand-in for the compiled vllm._moe_C_stable_libtorch (pure Python, vLLM 0.32.0 and 0.33.0).
# vllm/platforms/cuda.py imports vllm._moe_C_stable_libtorch (ImportError suppressed); without
# the real .so, torch.ops._moe_C does not exist and every MoE model fails at its first forward.
# This module defines the three ops that vLLM's unquantized Triton MoE path (TritonExperts,
# routed by FusedTopKRouter) calls, with pure-torch kernels:
#   topk_softmax          the router: softmax, top-k, optional renormalisation
#   moe_align_block_size  tokens grouped by expert, each group padded to the Triton block size
#   moe_sum               the top-k expert outputs of each token summed
# The expert GEMMs themselves stay vLLM's own Triton kernel (fused_moe_kernel).
#
# Every kernel is CUDA-graph capturable: fixed output shapes (the callers allocate them), no
# host sync (no .item(), no nonzero/bincount/boolean indexing whose size depends on data).
# Semantics follow vLLM's CUDA kernels (csrc/libtorch_stable/moe/): ties in top-k go to the
# lower expert index, a padded token (is_padding) routes to expert -1, expert ids outside
# [0, num_experts) or mapped to -1 are skipped by the alignment, blocks past the padded total
# hold expert -1, moe_sum adds up to 4 top-k rows in the input dtype one after another.
#
# The schemas are the real .so's (build_payload.sh checks them against it, modulo whitespace).
# Other _moe_C ops (grouped_topk, topk_sigmoid, marlin/wna16 GEMMs, permute, LoRA alignment)
# are left undefined: vLLM feature-detects some of them, and the unquantized softmax-routed
# path does not call the others.
import torch

SCHEMAS = {
    "topk_softmax": "topk_softmax(Tensor! topk_weights, Tensor! topk_indices, "
                    "Tensor! token_expert_indices, Tensor gating_output, bool renormalize, "
                    "Tensor? bias, Tensor? is_padding) -> ()",
    "moe_align_block_size": "moe_align_block_size(Tensor topk_ids, int num_experts, "
                            "int block_size, Tensor! sorted_token_ids, Tensor! experts_ids, "
                            "Tensor! num_tokens_post_pad, Tensor? maybe_expert_map, "
                            "Tensor(a!)? scatter_idx=None) -> ()",
    "moe_sum": "moe_sum(Tensor input, Tensor! output, Tensor? topk_ids=None, "
               "Tensor? expert_map=None) -> ()",
}


def topk_softmax(topk_weights, topk_indices, token_expert_indices, gating_output,
                 renormalize, bias=None, is_padding=None):
    """gating_output [T, E] -> topk_weights [T, k] (fp32), topk_indices [T, k],
    token_expert_indices [T, k] (= slot * T + token, the CUDA kernel's "source row")."""
    num_tokens, k = topk_weights.shape
    probs = torch.softmax(gating_output.float(), dim=-1)
    if is_padding is not None:
        # the CUDA kernel reads a padded row as zeros: uniform probabilities
        probs = torch.where(is_padding[:, None], torch.full_like(probs, 1.0 / probs.shape[-1]),
                            probs)
    choice = probs if bias is None else probs + bias.float()
    # stable descending sort: equal scores keep index order, so the lower expert wins a tie
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if is_padding is not None:
        ids = torch.where(is_padding[:, None], torch.full_like(ids, -1), ids)
    topk_weights.copy_(weights)
    topk_indices.copy_(ids)
    slots = torch.arange(k, device=gating_output.device, dtype=torch.int32)
    rows = torch.arange(num_tokens, device=gating_output.device, dtype=torch.int32)
    token_expert_indices.copy_(slots[None, :] * num_tokens + rows[:, None])


def moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids,
                         num_tokens_post_pad, maybe_expert_map=None, scatter_idx=None):
    """topk_ids [T, k] -> sorted_token_ids [P] (route indices into topk_ids.flatten(), grouped
    by expert, each group padded with numel to a multiple of block_size), experts_ids
    [P / block_size] (the expert of each block, -1 past the padded total),
    num_tokens_post_pad [1] (the padded total)."""
    device = topk_ids.device
    numel = topk_ids.numel()
    experts = topk_ids.reshape(-1).long()
    valid = (experts >= 0) & (experts < num_experts)
    experts = experts.clamp(0, num_experts - 1)
    if maybe_expert_map is not None:
        experts = maybe_expert_map.long()[experts]
        valid &= experts >= 0
    # invalid routes sort after every expert (key num_experts) and are never written
    keys = torch.where(valid, experts, torch.full_like(experts, num_experts))
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    counts = counts[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.sort(keys, stable=True).indices
    sorted_keys = keys[order]
    expert_of = sorted_keys.clamp(max=num_experts - 1)
    rank = torch.arange(numel, device=device) - count_start[expert_of]
    sorted_valid = sorted_keys < num_experts
    # invalid routes write to one spare slot past the end, cut off below
    capacity = sorted_token_ids.numel()
    dest = torch.where(sorted_valid, padded_start[expert_of] + rank,
                       torch.full_like(rank, capacity))
    out = torch.full((capacity + 1,), numel, dtype=torch.int32, device=device)
    out.scatter_(0, dest, order.to(torch.int32))
    sorted_token_ids.copy_(out[:capacity])
    total = padded_end[-1]
    block_starts = torch.arange(experts_ids.numel(), device=device) * block_size
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    experts_ids.copy_(torch.where(block_starts < total, block_expert,
                                  torch.full_like(block_expert, -1)))
    num_tokens_post_pad.copy_(total.view(1))
    if scatter_idx is not None:
        routes = torch.arange(numel, device=device, dtype=torch.int32)
        scatter_idx.copy_(torch.where(valid, routes, torch.full_like(routes, -1)).view(-1, 1))


def moe_sum(input, output, topk_ids=None, expert_map=None):
    """input [T, k, H] -> output [T, H]; with expert_map, slots whose expert is not on this
    rank (expert_map[id] == -1) are left out."""
    if expert_map is None and input.shape[1] > 4:
        torch.sum(input, dim=1, out=output)  # the CUDA op's at::sum_out beyond top-4
        return
    total = torch.zeros_like(output)
    for slot in range(input.shape[1]):
        row = input[:, slot]
        if expert_map is not None:
            local = expert_map[topk_ids[:, slot].long().clamp(0, expert_map.numel() - 1)]
            keep = (topk_ids[:, slot] >= 0) & (local >= 0)
            row = torch.where(keep[:, None], row, torch.zeros_like(row))
        total = total + row  # one rounding per addition, as the CUDA kernel's scalar_t loop
    output.copy_(total)


def register(namespace: str) -> torch.library.Library:
    """Define and implement the ops in torch.ops.<namespace> (vLLM's is "_moe_C")."""
    library = torch.library.Library(namespace, "FRAGMENT")
    for name, schema in SCHEMAS.items():
        library.define(schema)
        library.impl(name, globals()[name], "CompositeExplicitAutograd")
    return library


# Registered only when imported as vLLM's module, so tests can import the kernels alone.
if __name__ == "vllm._moe_C_stable_libtorch":
    _LIBRARY = register("_moe_C")
