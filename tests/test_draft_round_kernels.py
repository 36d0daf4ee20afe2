"""triton_ops.weaver_step: Triton (interpreted on CPU) and torch paths vs the float64 references."""

import pytest
import torch

from triton_ops.testing import rel_err
from triton_ops.weaver_step import (
    ExpandBatch,
    Frontier,
    GrowingTree,
    add_rms_norm,
    extend_paths,
    naive_node_attention,
    naive_rms_norm,
    node_attention,
    pop_frontier,
    push_children,
    rms_norm,
    silu_mul,
)

BACKENDS = ["triton", "torch"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 33), (4, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_float64(backend, shape, dtype, gen):
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=gen)
    bias = torch.randn(shape[-1], generator=gen)
    got = rms_norm(x, weight, bias, 1e-6, backend=backend)
    assert got.shape == x.shape and got.dtype == dtype
    ref = naive_rms_norm(x, weight, bias, 1e-6)
    assert not torch.isnan(got).any()
    assert rel_err(got, ref) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 33), (4, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_sum_then_its_norm(backend, shape, dtype, gen):
    """The sum as x + residual gives it (bit for bit, but for the interpreter's own bf16
    rounding: triton#11584), and the norm of that stored sum."""
    x, residual = ((torch.randn(*shape, generator=gen) * 3).to(dtype) for _ in range(2))
    weight, bias = torch.randn(shape[-1], generator=gen), torch.randn(shape[-1], generator=gen)
    total, normed = add_rms_norm(x, residual, weight, bias, 1e-6, backend=backend)
    assert total.shape == normed.shape == x.shape and total.dtype == normed.dtype == dtype
    if backend == "torch" or dtype == torch.float32:
        assert torch.equal(total, x + residual)
    else:
        assert rel_err(total, (x.double() + residual.double())) < 1e-2
    assert not torch.isnan(normed).any()
    assert rel_err(normed, naive_rms_norm(x + residual, weight, bias, 1e-6)) < (
        1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(1, 2), (3, 14), (2, 5, 66), (4, 260)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_float64(backend, shape, dtype, gen):
    gate_up = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    got = silu_mul(gate_up, backend=backend)
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert got.shape == up.shape and got.dtype == dtype
    assert not torch.isnan(got).any()
    assert rel_err(got, gate * torch.sigmoid(gate) * up) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_fused_ops_reject_bad_arguments(gen):
    x = torch.randn(2, 8, generator=gen)
    weight, bias = torch.ones(8), torch.zeros(8)
    with pytest.raises(ValueError, match="residual must be"):
        add_rms_norm(x, x[:, :4], weight, bias, 1e-6)
    with pytest.raises(ValueError, match="residual must be"):
        add_rms_norm(x, x.double(), weight, bias, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, x, weight[:4], bias, 1e-6)
    with pytest.raises(ValueError, match=r"gate_up must be a float \[..., 2M\]"):
        silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul(torch.ones(2, 8, dtype=torch.int64))


def _frontier(gen, R, C):
    # Coarse scores make ties; -inf entries stand for empty and spent columns.
    score = torch.randint(-3, 3, (R, C), generator=gen).float()
    score[torch.rand(R, C, generator=gen) < 0.3] = float("-inf")
    score[0, : C // 2] = float("-inf")  # a request whose frontier runs dry
    return Frontier(score, torch.randint(0, 50, (R, C), generator=gen),
                    torch.randint(0, 5, (R, C), generator=gen),
                    torch.randint(0, 6, (R, C), generator=gen), torch.randn(R, C, generator=gen))


def _tree(gen, R, N):
    def poisoned(dtype):
        return torch.full((R, N + 1), -7, dtype=dtype)

    num = torch.randint(1, 4, (R,), generator=gen)
    return GrowingTree(poisoned(torch.int64), poisoned(torch.int64), poisoned(torch.int64),
                       poisoned(torch.float32), num)


def _copy(state):
    return type(state)(*(t.clone() for t in state))


def _equal_state(a, b, drop_last_column=False):
    for x, y in zip(a, b):
        if drop_last_column and x.dim() == 2:  # the scratch column is free to differ
            x, y = x[:, :-1], y[:, :-1]
        assert torch.equal(x, y)


@pytest.mark.parametrize("R,C,count,max_depth", [(1, 1, 1, 3), (3, 17, 5, 4), (4, 600, 32, 2)])
def test_pop_frontier_matches_the_sorting_reference(R, C, count, max_depth, gen):
    frontier, tree = _frontier(gen, R, C), _tree(gen, R, count + 4)
    outs = []
    for backend in BACKENDS:
        f, t = _copy(frontier), _copy(tree)
        batch = pop_frontier(f, t, count, max_depth, backend=backend)
        outs.append((f, t, batch))
    (f1, t1, b1), (f2, t2, b2) = outs
    _equal_state(f1, f2)
    _equal_state(t1, t2, drop_last_column=True)
    real = b2.score > float("-inf")  # dry rows' other fields are free
    assert torch.equal(b1.score, b2.score)
    for x, y in zip(b1, b2):
        assert torch.equal(x[real], y[real])
    assert (b1.node[~real] == -1).all()
    # Brute force: the popped columns are the stable sort's first ``count``.
    for r in range(R):
        row = frontier.score[r].tolist()
        order = sorted(range(C), key=lambda c: (-row[c], c))[:count]
        assert b1.score[r].tolist() == [row[c] for c in order]
        taken = [c for c in order if row[c] > float("-inf")]
        assert int(t1.num[r] - tree.num[r]) == len(taken)
        assert (f1.score[r, order] == float("-inf")).all()


def _pushed_on_both_backends(gen, R, w, P, children, D, start, drawn=None, first_exponent=1.0):
    """A random push (some log q -inf, some nodes -1) on each backend, checked equal:
    (rows, pool_ids, batch, frontier before, frontier after)."""
    rows = torch.randint(-3, 1, (R, w, P), generator=gen).float()
    rows[torch.rand(R, w, P, generator=gen) < 0.2] = float("-inf")
    pool_ids = torch.randint(0, 100, (R, D, P), generator=gen)
    node = torch.randint(-1, 6, (R, w), generator=gen)
    batch = ExpandBatch(node, torch.zeros_like(node), torch.zeros_like(node),
                        torch.randint(0, D + 1, (R, w), generator=gen), torch.randn(R, w))
    frontier = _frontier(gen, R, start + w * children + 2)
    results = []
    for backend in BACKENDS:
        f = _copy(frontier)
        push_children(f, start, rows, batch, pool_ids, children, drawn=drawn,
                      first_exponent=first_exponent, backend=backend)
        results.append(f)
    _equal_state(*results)
    return rows, pool_ids, batch, frontier, results[0]


@pytest.mark.parametrize("R,w,P,children,D", [(1, 1, 1, 1, 1), (2, 3, 9, 4, 3), (1, 2, 20, 3, 2),
                                              (3, 4, 130, 8, 5)])
def test_push_children_matches_the_sorting_reference(R, w, P, children, D, gen):
    start = 3
    _, _, batch, frontier, pushed = _pushed_on_both_backends(gen, R, w, P, children, D, start)
    node = batch.node
    span = slice(start, start + w * children)
    for x, y in zip(pushed, frontier):  # columns outside the span are untouched
        assert torch.equal(x[:, :start], y[:, :start]) and torch.equal(x[:, span.stop:],
                                                                        y[:, span.stop:])
    got = pushed.score[:, span].view(R, w, children)
    assert torch.isneginf(got[node < 0]).all()


@pytest.mark.parametrize("R,w,P,children,D", [(1, 1, 1, 1, 1), (2, 3, 9, 4, 3), (3, 4, 130, 8, 5)])
@pytest.mark.parametrize("first_exponent", [1.0, 0.5, 0.3])
def test_a_sampled_push_scores_ranks_and_takes_the_drawn_tokens(R, w, P, children, D,
                                                                first_exponent, gen):
    """With ``drawn``, entry i of a node scores the node's score + its row's i-th largest
    log q (entry 0: ``first_exponent`` times it) whatever token was drawn there, and holds
    the i-th drawn token and its log q; both backends agree bit for bit."""
    drawn = torch.argsort(torch.rand(R, w, P, generator=gen), dim=-1)[..., :children]
    start = 2
    rows, pool_ids, batch, frontier, pushed = _pushed_on_both_backends(
        gen, R, w, P, children, D, start, drawn, first_exponent)
    node = batch.node
    span = slice(start, start + w * children)
    got = Frontier(*(t[:, span].reshape(R, w, children) for t in pushed))
    ranked = torch.sort(rows, dim=-1, descending=True).values[..., :children]
    ranked[..., 0] *= first_exponent
    score = torch.where((node >= 0)[..., None], batch.score[..., None] + ranked, float("-inf"))
    assert torch.equal(got.score, score)
    ids = pool_ids[torch.arange(R)[:, None], batch.depth.clamp(max=D - 1)]
    assert torch.equal(got.token, ids.gather(-1, drawn))
    assert torch.equal(got.logq, rows.gather(-1, drawn))
    assert torch.equal(got.depth, (batch.depth + 1)[..., None].expand(-1, -1, children))
    with pytest.raises(ValueError, match="drawn must be int64"):
        push_children(_copy(frontier), start, rows, batch, pool_ids, children,
                      drawn=drawn.int())


def test_frontier_ops_reject_bad_arguments(gen):
    frontier, tree = _frontier(gen, 2, 4), _tree(gen, 2, 3)
    with pytest.raises(ValueError, match="count must be an int in"):
        pop_frontier(frontier, tree, 5, 3)
    rows = torch.zeros(2, 1, 3)
    batch = ExpandBatch(*(torch.zeros(2, 1, dtype=torch.int64) for _ in range(4)),
                        torch.zeros(2, 1))
    with pytest.raises(ValueError, match="no room"):
        push_children(frontier, 2, rows, batch, torch.zeros(2, 1, 3, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="children must be in"):
        push_children(frontier, 0, rows, batch, torch.zeros(2, 1, 3, dtype=torch.int64), 4)
    drawn = torch.zeros(2, 1, 1, dtype=torch.int64)
    for exponent, given in ((0.5, None), (0.0, drawn), (1.5, drawn), (float("nan"), drawn)):
        with pytest.raises(ValueError, match="first_exponent must be"):
            push_children(frontier, 0, rows, batch, torch.zeros(2, 1, 3, dtype=torch.int64), 1,
                          drawn=given, first_exponent=exponent)


@pytest.mark.parametrize("backend", BACKENDS)
def test_extend_paths_records_parent_path_plus_node(backend, gen):
    R, N, D = 2, 7, 3
    paths = torch.full((R, N + 1, D + 1), -1, dtype=torch.int64)
    node_depth = torch.full((R, N + 1), -1, dtype=torch.int64)
    # Call 1: the roots (request 1 pads its second row); call 2: children, one at depth D.
    calls = [
        (torch.tensor([[0, -1], [0, -1]]), torch.tensor([[-1, -1], [-1, -1]]),
         torch.tensor([[0, 0], [0, 0]])),
        (torch.tensor([[1, 2], [1, -1]]), torch.tensor([[0, 0], [0, -1]]),
         torch.tensor([[1, 1], [1, 0]])),
        (torch.tensor([[3, -1], [2, -1]]), torch.tensor([[1, -1], [1, -1]]),
         torch.tensor([[2, 0], [2, 0]])),
        (torch.tensor([[4, -1], [3, -1]]), torch.tensor([[3, -1], [2, -1]]),
         torch.tensor([[3, 0], [3, 0]])),
    ]
    for node, parent, depth in calls:
        places = extend_paths(paths, node_depth, node, node + 10, parent, depth, backend=backend)
    assert places.ancestors[0, 0].tolist() == [0, 1, 3, -1]
    assert places.kv_slot.tolist() == [[N, N], [N, N]]  # depth D and padding: scratch
    assert places.positions.tolist() == [[1, 1], [1, 1]]
    assert places.pool_row.tolist() == [[-1, -1], [-1, -1]]
    assert paths[0, 4].tolist() == [0, 1, 3, 4] and paths[1, 3].tolist() == [0, 1, 2, 3]
    assert node_depth[0, :5].tolist() == [0, 1, 1, 2, 3]
    places = extend_paths(paths, node_depth, torch.tensor([[5, 6], [4, -1]]),
                          torch.tensor([[15, 16], [14, -5]]), torch.tensor([[2, 0], [1, -1]]),
                          torch.tensor([[2, 1], [2, 0]]), backend=backend)
    assert places.kv_slot.tolist() == [[5, 6], [4, N]]
    assert places.positions.tolist() == [[3, 2], [3, 1]]
    assert places.pool_row.tolist() == [[2, 1], [2, -1]]
    assert places.token_row.tolist() == [[15, 16], [14, 0]]  # padding reads row 0
    assert places.ancestors[0].tolist() == [[0, 2, -1, -1], [0, -1, -1, -1]]


def _attention_inputs(gen, R, w, H, hd, T, M, S, rotary, dtype):
    q, k, v = (torch.randn(R, w, H, hd, generator=gen).to(dtype) for _ in range(3))
    prefix_keys, prefix_values = (torch.randn(R, T, H, hd, generator=gen).to(dtype)
                                  for _ in range(2))
    node_keys, node_values = (torch.randn(R, M, H, hd, generator=gen).to(dtype)
                              for _ in range(2))
    # Distinct fresh slots per request for the w nodes (the last slot is scratch),
    # ancestors drawn from the other slots, -1 where a node has fewer.
    order = torch.stack([torch.randperm(M - 1, generator=gen) for _ in range(R)])
    kv_slot = order[:, :w].clone()
    kv_slot[:, -1] = M - 1  # one padding row per request
    ancestor_slots = order[:, w:][:, None, :S].expand(R, w, S).clone()
    ancestor_slots[torch.rand(R, w, S, generator=gen) < 0.4] = -1
    positions = tables = None
    if rotary:
        angles = torch.rand(20, hd // 2, generator=gen) * 6
        positions = torch.randint(0, 20, (R, w), generator=gen)
        tables = (angles.cos(), angles.sin())
    return (q, k, v, prefix_keys, prefix_values, node_keys, node_values, kv_slot,
            ancestor_slots, positions, tables)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("R,w,H,hd,T,S", [(1, 1, 1, 2, 1, 1), (2, 3, 2, 8, 5, 4),
                                          (3, 4, 2, 12, 16, 16), (1, 2, 3, 32, 9, 7)])
@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_node_attention_matches_float64(backend, R, w, H, hd, T, S, rotary, dtype, gen):
    M = w + S + 2
    inputs = _attention_inputs(gen, R, w, H, hd, T, M, S, rotary, dtype)
    q, k, v, pk, pv, nk, nv, kv_slot, ancestors, positions, rotary = inputs
    ref = naive_node_attention(q, k, v, pk, pv, nk, nv, ancestors, positions, rotary)
    before_keys, before_values = nk.clone(), nv.clone()
    got = node_attention(*inputs, backend=backend)
    assert got.dtype == torch.float32 and got.shape == q.shape
    assert not torch.isnan(got).any()
    real = kv_slot < M - 1  # the padding row's output is not used
    assert rel_err(got[real], ref[real]) < (1e-5 if dtype == torch.float32 else 2e-2)
    # The nodes' own K/V landed in their slots (rotated keys), nothing else moved.
    batch = torch.arange(R)[:, None]
    written = torch.zeros(R, M, dtype=torch.bool)
    written[batch, kv_slot] = True
    assert torch.equal(nk[~written], before_keys[~written])
    assert torch.equal(nv[~written], before_values[~written])
    assert torch.equal(nv[batch, kv_slot][real], v[real])
    key = k if rotary is None else _rotated(k, *(t[positions] for t in rotary))
    assert rel_err(nk[batch, kv_slot][real], key[real]) < (1e-6 if dtype == torch.float32 else 1e-2)


def _rotated(t, cos, sin):
    half = t.shape[-1] // 2
    c, s = torch.cat([cos, cos], -1)[:, :, None], torch.cat([sin, sin], -1)[:, :, None]
    tf = t.double()
    return (tf * c + torch.cat([-tf[..., half:], tf[..., :half]], -1) * s).to(t.dtype)


def test_node_attention_rejects_bad_arguments(gen):
    inputs = list(_attention_inputs(gen, 2, 2, 1, 4, 3, 6, 2, True, torch.float32))
    with pytest.raises(ValueError, match="kv_slot must be int64"):
        node_attention(*inputs[:7], inputs[7].int(), *inputs[8:])
    with pytest.raises(ValueError, match="positions and rotary must be given together"):
        node_attention(*inputs[:9], inputs[9], None)
    with pytest.raises(ValueError, match="prefix_keys must be"):
        node_attention(inputs[0], inputs[1], inputs[2], inputs[3][:, :, :, :2], *inputs[4:])
