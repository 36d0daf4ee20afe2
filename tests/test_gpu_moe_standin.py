"""The harness's pure-torch `_moe_C` ops (tools/gpu_vllm/_moe_C_stable_libtorch.py), which let
vLLM's Triton MoE path run on the lent H200 without vLLM's compiled ops.

On CPU (CI): each op against a slow loop that spells out the CUDA kernel's semantics, the
registered ops through torch.ops, and a whole Qwen3-Next-style MoE block — our router and
alignment feeding vLLM's own `fused_moe_kernel` (Triton interpreter) and our moe_sum —
against a plain torch MoE block in bf16. On a GPU (`-m gpu`): the ops captured in a CUDA
graph and replayed on new inputs give what they give eagerly.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

STANDIN = Path(__file__).resolve().parents[1] / "tools" / "gpu_vllm" / "_moe_C_stable_libtorch.py"


def _load_standin():
    spec = importlib.util.spec_from_file_location("moe_standin", STANDIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not vllm._moe_C_stable_libtorch: registers nothing
    return module


moe = _load_standin()


# ---- slow references: the CUDA kernels' semantics, one token / route at a time ----

def naive_topk_softmax(logits, k, renormalize, bias=None, is_padding=None):
    num_tokens, num_experts = logits.shape
    weights = torch.zeros(num_tokens, k)
    ids = torch.zeros(num_tokens, k, dtype=torch.int32)
    for t in range(num_tokens):
        pad = is_padding is not None and bool(is_padding[t])
        probs = torch.full((num_experts,), 1.0 / num_experts) if pad else \
            torch.softmax(logits[t].float(), -1)
        score = probs + (bias.float() if bias is not None else 0.0)
        taken: list[int] = []
        for _ in range(k):
            best = max((e for e in range(num_experts) if e not in taken),
                       key=lambda e: (float(score[e]), -e))  # tie: lower index
            taken.append(best)
        w = probs[taken]
        if renormalize:
            w = w / w.sum()
        weights[t] = w
        ids[t] = torch.tensor([-1] * k if pad else taken, dtype=torch.int32)
    return weights, ids


def naive_align(topk_ids, num_experts, block_size, capacity, expert_map=None):
    flat = [int(x) for x in topk_ids.reshape(-1)]
    numel = len(flat)
    groups: list[list[int]] = [[] for _ in range(num_experts)]
    for route, expert in enumerate(flat):
        if not 0 <= expert < num_experts:
            continue
        if expert_map is not None:
            expert = int(expert_map[expert])
            if expert < 0:
                continue
        groups[expert].append(route)
    sorted_ids, block_experts = [], []
    for expert, routes in enumerate(groups):
        padded = -(-len(routes) // block_size) * block_size
        sorted_ids += routes + [numel] * (padded - len(routes))
        block_experts += [expert] * (padded // block_size)
    total = len(sorted_ids)
    num_blocks = -(-capacity // block_size)
    sorted_ids += [numel] * (capacity - total)
    block_experts += [-1] * (num_blocks - len(block_experts))
    return sorted_ids, block_experts, total


def align_buffers(topk_ids, num_experts, block_size):
    """The buffers vLLM's moe_align_block_size wrapper allocates (same sizes)."""
    capacity = topk_ids.numel() + num_experts * (block_size - 1)
    if topk_ids.numel() < num_experts:
        capacity = min(topk_ids.numel() * block_size, capacity)
    return (torch.empty(capacity, dtype=torch.int32),
            torch.empty(-(-capacity // block_size), dtype=torch.int32),
            torch.empty(1, dtype=torch.int32))


# ---- the ops against the references ----

@pytest.mark.parametrize("num_tokens,num_experts,k", [(1, 1, 1), (7, 1, 1), (9, 8, 2),
                                                      (5, 6, 6), (33, 64, 4)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax_matches_the_kernel_semantics(gen, num_tokens, num_experts, k,
                                                   renormalize):
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(torch.bfloat16)
    if num_experts > 1:
        logits[0, 1] = logits[0, 0]  # a tie: expert 0 must win it
    bias = torch.randn(num_experts, generator=gen) * 0.1
    is_padding = torch.rand(num_tokens, generator=gen) < 0.3
    for use_bias, use_padding in [(False, False), (True, False), (False, True)]:
        b = bias if use_bias else None
        p = is_padding if use_padding else None
        weights = torch.empty(num_tokens, k)
        ids = torch.empty(num_tokens, k, dtype=torch.int32)
        rows = torch.empty(num_tokens, k, dtype=torch.int32)
        moe.topk_softmax(weights, ids, rows, logits, renormalize, b, p)
        want_w, want_ids = naive_topk_softmax(logits, k, renormalize, b, p)
        assert torch.equal(ids, want_ids), (use_bias, use_padding)
        torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
        slot = torch.arange(k)[None, :]
        token = torch.arange(num_tokens)[:, None]
        assert torch.equal(rows, (slot * num_tokens + token).int())


@pytest.mark.parametrize("num_tokens,num_experts,k,block_size", [
    (1, 1, 1, 16), (13, 1, 1, 16), (300, 1, 1, 64), (5, 8, 2, 16), (40, 8, 2, 4),
    (3, 64, 4, 16), (257, 16, 3, 32)])
def test_moe_align_block_size_matches_the_kernel_semantics(gen, num_tokens, num_experts, k,
                                                           block_size):
    topk_ids = torch.stack([torch.randperm(num_experts, generator=gen)[:k]
                            for _ in range(num_tokens)]).int()
    if num_tokens > 2:
        topk_ids[1] = -1  # a padded token (topk_softmax's is_padding rows)
        topk_ids[2, 0] = num_experts  # an out-of-range id: skipped like the CUDA kernel
    sorted_ids, block_experts, total = align_buffers(topk_ids, num_experts, block_size)
    scatter = torch.empty(topk_ids.numel(), 1, dtype=torch.int32)
    moe.moe_align_block_size(topk_ids, num_experts, block_size, sorted_ids, block_experts,
                             total, None, scatter)
    want_ids, want_blocks, want_total = naive_align(topk_ids, num_experts, block_size,
                                                    sorted_ids.numel())
    assert sorted_ids.tolist() == want_ids
    assert block_experts.tolist() == want_blocks
    assert total.tolist() == [want_total]
    flat = topk_ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    assert scatter.view(-1).tolist() == torch.where(valid, torch.arange(flat.numel()),
                                                    torch.tensor(-1)).tolist()


def test_moe_align_block_size_with_an_expert_map_drops_remote_experts(gen):
    num_experts, k, block_size = 8, 2, 4
    topk_ids = torch.stack([torch.randperm(num_experts, generator=gen)[:k]
                            for _ in range(11)]).int()
    expert_map = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3], dtype=torch.int32)  # rank 1 of 2
    sorted_ids, block_experts, total = align_buffers(topk_ids, num_experts, block_size)
    moe.moe_align_block_size(topk_ids, num_experts, block_size, sorted_ids, block_experts,
                             total, expert_map)
    want_ids, want_blocks, want_total = naive_align(topk_ids, num_experts, block_size,
                                                    sorted_ids.numel(), expert_map)
    assert (sorted_ids.tolist(), block_experts.tolist(), total.item()) == \
        (want_ids, want_blocks, want_total)


@pytest.mark.parametrize("k", [1, 2, 4, 6])
def test_moe_sum_adds_the_topk_rows(gen, k):
    rows = torch.randn(9, k, 48, generator=gen).to(torch.bfloat16)
    out = torch.empty(9, 48, dtype=torch.bfloat16)
    moe.moe_sum(rows, out)
    want = rows[:, 0].clone()
    for slot in range(1, k):
        want = want + rows[:, slot]  # bf16 rounding after every addition
    if k > 4:
        want = rows.sum(1)
    assert torch.equal(out, want)
    if k >= 2:
        topk_ids = torch.tensor([[0, 1] + [0] * (k - 2)] * 9, dtype=torch.int32)
        expert_map = torch.tensor([-1, 0], dtype=torch.int32)  # expert 0 lives elsewhere
        moe.moe_sum(rows, out, topk_ids, expert_map)
        assert torch.equal(out, rows[:, 1])


@pytest.fixture(scope="module")
def standin_ops():
    library = moe.register("_moe_C_standin_test")  # vLLM's own CPU build may own "_moe_C"
    yield torch.ops._moe_C_standin_test
    del library


def test_registered_ops_write_their_outputs_in_place(standin_ops, gen):
    logits = torch.randn(6, 4, generator=gen)
    weights, ids = torch.empty(6, 2), torch.empty(6, 2, dtype=torch.int32)
    rows = torch.empty(6, 2, dtype=torch.int32)
    standin_ops.topk_softmax(weights, ids, rows, logits, True, None, None)
    torch.testing.assert_close(weights.sum(-1), torch.ones(6))
    sorted_ids, block_experts, total = align_buffers(ids, 4, 16)
    standin_ops.moe_align_block_size(ids, 4, 16, sorted_ids, block_experts, total, None)
    assert total.item() % 16 == 0 and total.item() >= 12
    out = torch.empty(6, 8)
    standin_ops.moe_sum(torch.ones(6, 2, 8), out)
    assert torch.equal(out, torch.full((6, 8), 2.0))


# ---- a whole MoE block: our ops around vLLM's own Triton expert GEMM ----

def reference_moe_block(x, gate_w, w13, w2, k, renormalize):
    """Plain torch, token by token: softmax router, top-k experts, SiLU-gated MLPs."""
    probs = torch.softmax((x @ gate_w.T).float(), -1)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        weights, ids = probs[t].topk(k)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, ids):
            gate_up = (x[t] @ w13[e].T).float()
            half = gate_up.shape[-1] // 2
            h = (F.silu(gate_up[:half]) * gate_up[half:]).to(x.dtype)
            out[t] += float(w) * (h @ w2[e].T).float()
    return out


def vllm_fused_moe_launcher():
    """vLLM's own `invoke_fused_moe_triton_kernel` and the Triton kernels it launches, bound
    to the real Triton. vLLM's CPU build replaces Triton with placeholders (no CPU backend),
    so its functions are compiled again from vLLM's file, at their own line numbers (Triton
    reads a kernel's source back through them), with the module's other globals kept."""
    pytest.importorskip("vllm")
    import triton
    import triton.language as tl
    from vllm.model_executor.layers.fused_moe import fused_moe

    path = fused_moe.__file__
    tree = ast.parse(Path(path).read_text(), path)
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and (
        node.name == "invoke_fused_moe_triton_kernel"
        or any("jit" in ast.unparse(d) for d in node.decorator_list))]
    namespace = {**vars(fused_moe), "triton": triton, "tl": tl}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), path, "exec"), namespace)
    return namespace["invoke_fused_moe_triton_kernel"], tl


def standin_moe_block(x, gate_w, w13, w2, k, renormalize):
    """What vLLM's TritonExperts does, with the stand-in's ops where _moe_C's would run."""
    invoke_fused_moe_triton_kernel, tl = vllm_fused_moe_launcher()
    num_tokens, num_experts = x.shape[0], w13.shape[0]
    config = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1}
    logits = (x @ gate_w.T).float()
    weights = torch.empty(num_tokens, k)
    ids = torch.empty(num_tokens, k, dtype=torch.int32)
    rows = torch.empty(num_tokens, k, dtype=torch.int32)
    moe.topk_softmax(weights, ids, rows, logits, renormalize)
    sorted_ids, block_experts, total = align_buffers(ids, num_experts, config["BLOCK_SIZE_M"])
    moe.moe_align_block_size(ids, num_experts, config["BLOCK_SIZE_M"], sorted_ids,
                             block_experts, total)
    gemm = dict(A_scale=None, B_scale=None, sorted_token_ids=sorted_ids,
                expert_ids=block_experts, num_tokens_post_padded=total, config=config,
                compute_type=tl.float32 if x.dtype == torch.float32 else tl.bfloat16,
                use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=False)
    gate_up = torch.zeros(num_tokens, k, w13.shape[1], dtype=x.dtype)
    invoke_fused_moe_triton_kernel(x, w13, gate_up, topk_weights=None,
                                   mul_routed_weight=False, top_k=k, **gemm)
    half = w13.shape[1] // 2
    h = gate_up.view(-1, w13.shape[1]).float()
    h = (F.silu(h[:, :half]) * h[:, half:]).to(x.dtype)
    down = torch.zeros(num_tokens, k, w2.shape[1], dtype=x.dtype)
    invoke_fused_moe_triton_kernel(h, w2, down, topk_weights=weights,
                                   mul_routed_weight=True, top_k=1, **gemm)
    out = torch.empty(num_tokens, w2.shape[1], dtype=x.dtype)
    moe.moe_sum(down, out)
    return out


@pytest.mark.parametrize("num_experts,k,renormalize", [(1, 1, True), (4, 2, True),
                                                       (8, 2, False)])
def test_moe_block_with_vllm_triton_gemm_matches_plain_torch(gen, num_experts, k,
                                                             renormalize):
    # fp32: the Triton interpreter returns garbage from this kernel in bf16 (a CPU-only
    # quirk; bf16 on the GPU is what tools/gpu_e2e.py's greedy comparison checks)
    hidden, inter, num_tokens = 64, 32, 5
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_w = torch.randn(num_experts, hidden, generator=gen) * 0.2
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.1
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * 0.1
    want = reference_moe_block(x, gate_w, w13, w2, k, renormalize)
    got = standin_moe_block(x, gate_w, w13, w2, k, renormalize)
    ratio = float((got - want).norm() / want.norm())
    assert ratio < 1e-5, f"relative error {ratio:.2e} to the plain torch block's norm"


# ---- on a GPU: the ops replay from a CUDA graph ----

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ops_replay_from_a_cuda_graph_as_they_run_eagerly(gen):
    device, num_tokens, num_experts, k, block_size = "cuda", 8, 8, 2, 16
    logits = torch.randn(num_tokens, num_experts, device=device)
    is_padding = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    weights = torch.empty(num_tokens, k, device=device)
    ids = torch.empty(num_tokens, k, dtype=torch.int32, device=device)
    rows = torch.empty(num_tokens, k, dtype=torch.int32, device=device)
    buffers = [b.to(device) for b in align_buffers(ids.cpu(), num_experts, block_size)]
    rows_in = torch.randn(num_tokens, k, 64, device=device, dtype=torch.bfloat16)
    summed = torch.empty(num_tokens, 64, device=device, dtype=torch.bfloat16)

    def step():
        moe.topk_softmax(weights, ids, rows, logits, True, None, is_padding)
        moe.moe_align_block_size(ids, num_experts, block_size, *buffers)
        moe.moe_sum(rows_in, summed)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # warm-up outside the graph (allocator, lazy init)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        logits.copy_(torch.randn(num_tokens, num_experts, generator=gen))
        is_padding.copy_(torch.rand(num_tokens, generator=gen) < 0.25)
        rows_in.copy_(torch.randn(num_tokens, k, 64, generator=gen))
        graph.replay()
        replayed = [t.clone() for t in (weights, ids, *buffers, summed)]
        step()
        assert all(torch.equal(a, b) for a, b in zip(replayed, (weights, ids, *buffers,
                                                                 summed)))
