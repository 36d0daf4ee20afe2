"""triton_ops.weaver_step: Triton (interpreted on CPU) and torch paths vs the float64 references."""

import pytest
import torch

from triton_ops.testing import rel_err
from triton_ops.weaver_step import (
    naive_node_attention,
    naive_rms_norm,
    naive_take_top,
    node_attention,
    rms_norm,
    take_top,
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


def _rows_with_ties(gen, n, width):
    # Coarse values make ties; -inf entries stand for padding rows and spent slots.
    values = torch.randint(-3, 3, (n, width), generator=gen).float()
    values[torch.rand(n, width, generator=gen) < 0.3] = float("-inf")
    values[0] = float("-inf")  # a row of padding only
    return values


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,width,count", [(1, 1, 1), (3, 6, 6), (5, 37, 8), (4, 600, 32)])
def test_take_top_orders_like_a_stable_sort(backend, n, width, count, gen):
    values = _rows_with_ties(gen, n, width)
    want_top, want_columns = naive_take_top(values, count)
    top, columns = take_top(values, count, backend=backend)
    assert torch.equal(columns, want_columns) and torch.equal(top, want_top)
    spent = values.clone()
    top, columns = take_top(spent, count, consume=True, backend=backend)
    assert torch.equal(columns, want_columns)
    expected = values.clone()
    expected.scatter_(1, want_columns, float("-inf"))
    assert torch.equal(spent, expected)


def test_take_top_rejects_bad_arguments():
    with pytest.raises(ValueError, match="count must be an int in"):
        take_top(torch.zeros(2, 3), 4)
    with pytest.raises(ValueError, match="values must be a float32"):
        take_top(torch.zeros(2, 3, dtype=torch.float64), 1)
    with pytest.raises(ValueError, match="contiguous"):
        take_top(torch.zeros(3, 2).t(), 1, consume=True)


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
    cos = sin = None
    if rotary:
        angles = torch.rand(R, w, hd // 2, generator=gen) * 6
        cos, sin = angles.cos(), angles.sin()
    return (q, k, v, prefix_keys, prefix_values, node_keys, node_values, kv_slot,
            ancestor_slots, cos, sin)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("R,w,H,hd,T,S", [(1, 1, 1, 2, 1, 1), (2, 3, 2, 8, 5, 4),
                                          (3, 4, 2, 12, 16, 16), (1, 2, 3, 32, 9, 7)])
@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_node_attention_matches_float64(backend, R, w, H, hd, T, S, rotary, dtype, gen):
    M = w + S + 2
    inputs = _attention_inputs(gen, R, w, H, hd, T, M, S, rotary, dtype)
    q, k, v, pk, pv, nk, nv, kv_slot, ancestors, cos, sin = inputs
    ref = naive_node_attention(q, k, v, pk, pv, nk, nv, ancestors, cos, sin)
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
    key = k if cos is None else _rotated(k, cos, sin)
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
    with pytest.raises(ValueError, match="cos and sin must be given together"):
        node_attention(*inputs[:9], inputs[9], None)
    with pytest.raises(ValueError, match="prefix_keys must be"):
        node_attention(inputs[0], inputs[1], inputs[2], inputs[3][:, :, :, :2], *inputs[4:])
