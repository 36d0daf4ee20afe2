"""Tree causal conv1d and its commit against the float64 per-node reference."""

from __future__ import annotations

import pytest
import torch

from triton_ops.testing import TREE_SHAPES, random_tree_metadata, rel_err, same_bits
from triton_ops.tree_conv import (
    naive_tree_conv1d,
    naive_tree_conv1d_commit,
    tree_conv1d,
    tree_conv1d_commit,
    tree_conv1d_commit_layers,
)
from triton_ops.tree_metadata import build_tree_metadata


def conv_inputs(B, N, C, W, num_slots, dtype, gen, with_bias=True):
    """Inputs in engine-like layouts: x a strided slice, conv_state the
    transposed view of a [slots, W-1, C] buffer (vLLM stores the state dim-last)."""
    x = torch.randn(B, N, 2 * C, generator=gen).to(dtype)[:, :, ::2]
    weight = (torch.randn(C, W, generator=gen) / W).to(dtype)
    bias = torch.randn(C, generator=gen).to(dtype) if with_bias else None
    storage = torch.full((num_slots, W - 1, C), float("nan"), dtype=dtype)
    conv_state = storage.transpose(1, 2)
    slots = torch.randperm(num_slots, generator=gen)[:B].to(torch.int32)
    conv_state[slots.long()] = torch.randn(B, C, W - 1, generator=gen).to(dtype)
    return x, weight, bias, conv_state, slots


def poison_padding(x: torch.Tensor, meta) -> None:
    x[~meta.valid] = float("nan")


BACKENDS = ("torch", "triton")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("with_bias", [True, False])
def test_chain_is_causal_conv1d(backend, W, with_bias, gen):
    B, N, C = 2, 7, 24
    meta = random_tree_metadata(gen, ["chain"] * B, N, [N] * B, W)
    x, weight, bias, conv_state, slots = conv_inputs(B, N, C, W, 5, torch.float32, gen, with_bias)
    out = torch.full((B, N, C), float("nan"))
    y = tree_conv1d(x, weight, bias, conv_state, slots, meta, "silu", backend=backend, out=out)
    assert y is out
    for b in range(B):
        seq = torch.cat([conv_state[slots[b].long()], x[b].t()], dim=1).unsqueeze(0)
        ref = torch.nn.functional.conv1d(seq.double(), weight.double().unsqueeze(1),
                                         None if bias is None else bias.double(), groups=C)
        ref = torch.nn.functional.silu(ref[0].t())
        assert rel_err(y[b], ref) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("kind", TREE_SHAPES)
def test_trees_match_naive(backend, W, kind, gen):
    B, N, C = 3, 19, 40
    num_nodes = [N, 1, int(torch.randint(2, N, (1,), generator=gen))]
    meta = random_tree_metadata(gen, [kind, kind, "random"], N, num_nodes, W)
    x, weight, bias, conv_state, slots = conv_inputs(
        B, N, C, W, 6, torch.float32, gen, with_bias=W != 3
    )
    poison_padding(x, meta)
    for activation in ("silu", None):
        out = torch.full((B, N, C), float("nan"))
        tree_conv1d(x, weight, bias, conv_state, slots, meta, activation, backend=backend, out=out)
        ref = naive_tree_conv1d(x, weight, bias, conv_state, slots, meta, activation)
        assert rel_err(out, ref) < 1e-6
        assert (out[~meta.valid] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_out_receives_the_real_nodes_inputs(backend, dtype, gen):
    """``inputs_out`` gets each real node's input bit for bit (padding rows untouched),
    and the conv's output is the same as without it."""
    B, N, C, W = 3, 17, 40, 4
    meta = random_tree_metadata(gen, ["bushy", "chain", "random"], N, [17, 5, 11], W)
    x, weight, bias, conv_state, slots = conv_inputs(B, N, C, W, 4, dtype, gen)
    plain = tree_conv1d(x, weight, bias, conv_state, slots, meta, backend=backend)
    storage = torch.full((B, N, C + 3), float("nan"), dtype=dtype)
    inputs = storage[..., 1 : C + 1]  # any strides
    y = tree_conv1d(x, weight, bias, conv_state, slots, meta, backend=backend, inputs_out=inputs)
    assert torch.equal(y, plain)
    assert same_bits(inputs[meta.valid], x[meta.valid])
    assert inputs[~meta.valid].isnan().all()
    assert storage[..., 0].isnan().all() and storage[..., C + 1 :].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_torch_path(dtype, gen):
    # The interpreter's bf16 is unreliable (triton#11584): half dtypes are covered on CPU
    # by the torch path here and by the CUDA check in tools/bench_kernels.py --only conv.
    B, N, C, W = 4, 33, 64, 4
    meta = random_tree_metadata(gen, ["random", "forest", "star", "bushy"], N, [33, 20, 9, 1], W)
    x, weight, bias, conv_state, slots = conv_inputs(B, N, C, W, 4, dtype, gen)
    y = tree_conv1d(x, weight, bias, conv_state, slots, meta, backend="torch")
    assert y.dtype == dtype
    ref = naive_tree_conv1d(x, weight, bias, conv_state, slots, meta)
    assert rel_err(y, ref) < 1e-2


def test_padding_slot_reads_zero_state(gen):
    B, N, C, W = 2, 6, 16, 4
    meta = random_tree_metadata(gen, ["random", "chain"], N, [6, 4], W)
    x, weight, bias, conv_state, slots = conv_inputs(B, N, C, W, 3, torch.float32, gen)
    slots[1] = -1
    zero_state = torch.zeros(1, C, W - 1)
    for backend in BACKENDS:
        out = torch.full((B, N, C), float("nan"))
        tree_conv1d(x, weight, bias, conv_state, slots, meta, backend=backend, out=out)
        ref = naive_tree_conv1d(x[1:], weight, bias, zero_state, torch.zeros(1, dtype=torch.int32),
                                build_tree_metadata(meta.parents[1:], meta.num_nodes[1:], W))
        assert rel_err(out[1:], ref) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_commit_every_node(backend, W, dtype, gen):
    if backend == "triton" and dtype == torch.bfloat16:
        # Pure data movement, but still keep bf16 off the interpreter.
        dtype = torch.float16
    B, N, C = 3, 9, 20
    num_nodes = [9, 5, 1]
    meta = random_tree_metadata(gen, ["random", "forest", "chain"], N, num_nodes, W)
    x, _, _, conv_state, slots = conv_inputs(B, N, C, W, 4, dtype, gen)
    poison_padding(x, meta)
    for node in range(-1, N):
        leaf = torch.tensor([node if node < n else -1 for n in num_nodes], dtype=torch.int64)
        state = conv_state.clone()
        expected = naive_tree_conv1d_commit(state, slots, x, meta, leaf)
        tree_conv1d_commit(state, slots, x, meta, leaf, backend=backend)
        assert same_bits(state, expected)
        for b in range(B):
            slot = slots[b].long()
            if leaf[b] < 0:
                assert same_bits(state[slot], conv_state[slot])
                continue
            # The same state as a chain conv fed with the accepted path, token by token.
            window = conv_state[slot].clone()
            path = meta.ancestors[b, leaf[b]].nonzero().squeeze(1)
            for j in path.tolist():
                window = torch.cat([window[:, 1:], x[b, j].to(dtype).unsqueeze(1)], dim=1)
            assert same_bits(state[slot], window)


def test_commit_padding_slot_untouched(gen):
    B, N, C, W = 2, 5, 8, 4
    meta = random_tree_metadata(gen, ["chain", "chain"], N, [5, 5], W)
    x, _, _, conv_state, slots = conv_inputs(B, N, C, W, 2, torch.float32, gen)
    slots[0] = -1
    for backend in BACKENDS:
        state = conv_state.clone()
        tree_conv1d_commit(state, slots, x, meta, torch.tensor([4, 4]), backend=backend)
        other = [s for s in range(conv_state.shape[0]) if s != slots[1]]
        assert same_bits(state[other], conv_state[other])
        assert same_bits(state[slots[1].long()], torch.cat([x[1, 2:].t()], dim=1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("C", [20, 300])  # 300: two channel blocks
def test_commit_of_several_layers_commits_each_as_its_own_commit(backend, C, gen):
    """tree_conv1d_commit_layers (one launch for a step's GDN layers: conv states in one
    buffer or apart, inputs and slots of their own) leaves every layer's conv state as
    that layer's own tree_conv1d_commit does, bit for bit; layers unlike layer 0 are
    refused by name."""
    B, N, W, layers, num_slots = 3, 9, 4, 3, 5
    meta = random_tree_metadata(gen, ["random", "forest", "chain"], N, [9, 5, 3], W)
    storage = torch.randn(layers - 1, num_slots, W - 1, C, generator=gen)
    apart = torch.randn(num_slots, W - 1, C, generator=gen)
    states = [state.transpose(1, 2) for state in (*storage, apart)]
    xs, slots = [], []
    for _ in range(layers):
        x, _, _, _, layer_slots = conv_inputs(B, N, C, W, num_slots, torch.float32, gen)
        xs.append(x)
        slots.append(layer_slots)
    slots[1][2] = -1  # vLLM's padding slot: never written
    leaf = torch.tensor([8, -1, 2])
    one_by_one = [state.clone() for state in states]
    for state, layer_slots, x in zip(one_by_one, slots, xs):
        tree_conv1d_commit(state, layer_slots, x, meta, leaf, backend=backend)
    before = [state.clone() for state in states]
    tree_conv1d_commit_layers(states, slots, xs, meta, leaf, backend=backend)
    for state, want, old in zip(states, one_by_one, before):
        assert same_bits(state, want) and not same_bits(state, old)
    with pytest.raises(ValueError, match=r"xs\[1\] must match xs\[0\]'s dtype, shape, strides"):
        tree_conv1d_commit_layers(states[:2], slots[:2], [xs[0], xs[1].contiguous()], meta, leaf,
                                  backend="triton")
    with pytest.raises(ValueError, match="one entry per layer"):
        tree_conv1d_commit_layers(states, slots, xs[:2], meta, leaf)


def test_bad_inputs_name_the_argument(gen, monkeypatch):
    B, N, C, W = 2, 4, 8, 4
    meta = random_tree_metadata(gen, ["chain", "star"], N, [4, 3], W)
    x, weight, bias, conv_state, slots = conv_inputs(B, N, C, W, 3, torch.float32, gen)
    good = dict(x=x, weight=weight, bias=bias, conv_state=conv_state, state_slots=slots, meta=meta)
    bad_cases = {
        "x": x[:, :3],
        "weight": weight[:, :3],
        "bias": bias[:4],
        "conv_state": conv_state[:, :, :2],
        "state_slots": slots.float(),
    }
    for name, value in bad_cases.items():
        with pytest.raises(ValueError, match=name):
            tree_conv1d(**{**good, name: value})
    with pytest.raises(ValueError, match="state_slots"):
        tree_conv1d(**{**good, "state_slots": torch.tensor([0, 3], dtype=torch.int32)})
    with pytest.raises(ValueError, match="activation"):
        tree_conv1d(**good, activation="gelu")
    with pytest.raises(ValueError, match="backend"):
        tree_conv1d(**good, backend="cuda")
    with pytest.raises(ValueError, match="out"):
        tree_conv1d(**good, out=torch.empty(B, N, C + 1))
    with pytest.raises(ValueError, match="inputs_out must be"):
        tree_conv1d(**good, inputs_out=torch.empty(B, N, C, dtype=torch.float64))
    with pytest.raises(ValueError, match="conv_width"):
        tree_conv1d(**{**good, "meta": random_tree_metadata(gen, ["chain"] * 2, N, [4, 4], 1)})
    with pytest.raises(ValueError, match="accepted_leaf"):
        tree_conv1d_commit(conv_state, slots, x, meta, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="accepted_leaf"):
        tree_conv1d_commit(conv_state, slots, x, meta, torch.tensor([0]))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors.*TRITON_INTERPRET=1"):
        tree_conv1d(**good, backend="triton")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        tree_conv1d_commit(conv_state, slots, x, meta, torch.tensor([0, 0]), backend="triton")
