"""Tree attention and KV commit against SDPA and the float64 reference.

Caches are filled with NaN before the used positions are written, so a kernel
that reads a padded node, a position past the tree or an unused block fails;
outputs start as NaN, so a row the kernels never write fails too. The Triton
kernels also run under explicit launch parameters (tiles, split counts, rescale
rules) on random shapes whose seed the ``gen`` fixture prints.
"""

from __future__ import annotations

import math

import pytest
import torch

from triton_ops.testing import random_tree_metadata, rel_err, same_bits
from triton_ops.tree_attention import (
    naive_tree_attention,
    naive_tree_kv_commit,
    paged_tree_attention,
    tree_kv_commit,
)
from triton_ops.tree_attention.attention import (
    MAX_SPLITS,
    SPLIT_TOLERANCE,
    TILE_COST,
    KernelConfig,
    launch_tree_attention,
    split_count,
    tile_height,
)

BACKENDS = ("torch", "triton")
LAYOUTS = ("contiguous", "kv_stacked", "hnd", "cpu_attn")


def empty_caches(num_blocks, block_size, Hkv, D, layout, dtype, num_layers=1):
    """NaN-filled (key, value) views [num_blocks, block_size, Hkv, D] per layer, laid
    out like vLLM's backends: plain, K/V stacked per block, or head-major (HND)."""
    shape = (num_layers, num_blocks, block_size, Hkv, D)
    if layout == "contiguous":
        keys, values = torch.full(shape, math.nan, dtype=dtype), torch.full(shape, math.nan, dtype=dtype)
    elif layout == "kv_stacked":
        both = torch.full((num_layers, num_blocks, 2, block_size, Hkv, D), math.nan, dtype=dtype)
        keys, values = both[:, :, 0], both[:, :, 1]
    elif layout == "cpu_attn":
        # vLLM's CPU_ATTN block per kv head: keys transposed [D, block_size], then
        # values [block_size, D]; keys and values have different strides.
        raw = torch.full((num_layers, num_blocks, Hkv, block_size, 2 * D), math.nan, dtype=dtype)
        size = (num_layers, num_blocks, block_size, Hkv, D)
        L, B_, H_, _, _ = raw.stride()
        keys = raw.as_strided(size, (L, B_, 1, H_, block_size))
        values = raw.as_strided(size, (L, B_, D, H_, 1), block_size * D)
    elif layout == "hnd":
        hnd = (num_layers, num_blocks, Hkv, block_size, D)
        keys = torch.full(hnd, math.nan, dtype=dtype).transpose(2, 3)
        values = torch.full(hnd, math.nan, dtype=dtype).transpose(2, 3)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return list(keys.unbind(0)), list(values.unbind(0))


def make_paged_batch(prefix_lens, num_nodes, Hkv, D, block_size, layout, dtype, gen, num_layers=1):
    """Caches holding random K/V at positions [0, prefix + num_nodes) of each request
    (NaN elsewhere), a shuffled block table whose unused entries are invalid ids, and
    the per-request logical K/V [L_b, Hkv, D] of the first layer."""
    lengths = [p + n for p, n in zip(prefix_lens, num_nodes)]
    blocks_needed = [-(-length // block_size) for length in lengths]
    num_blocks = sum(blocks_needed) + 3
    key_caches, value_caches = empty_caches(num_blocks, block_size, Hkv, D, layout, dtype, num_layers)
    block_table = torch.full((len(lengths), max(blocks_needed) + 1), num_blocks + 7, dtype=torch.int32)
    free = torch.randperm(num_blocks, generator=gen)
    logical = []
    for b, (length, need) in enumerate(zip(lengths, blocks_needed)):
        block_table[b, :need] = free[:need]
        free = free[need:]
        pos = torch.arange(length)
        blk, off = block_table[b, pos // block_size].long(), pos % block_size
        for layer in range(num_layers):
            k = torch.randn(length, Hkv, D, generator=gen).to(dtype)
            v = torch.randn(length, Hkv, D, generator=gen).to(dtype)
            key_caches[layer][blk, off] = k
            value_caches[layer][blk, off] = v
            if layer == 0:
                logical.append((k, v))
    return key_caches, value_caches, block_table, logical


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_chain_is_causal_attention(backend, sliding_window, gen):
    B, N, Hkv, G, D, bs = 2, 9, 2, 2, 32, 16
    prefix_lens = [21, 40]
    meta = random_tree_metadata(gen, ["chain"] * B, N, [N] * B)
    keys, values, block_table, logical = make_paged_batch(
        prefix_lens, [N] * B, Hkv, D, bs, "contiguous", torch.float32, gen
    )
    q = torch.randn(B, N, Hkv * G, D, generator=gen)
    out = torch.full_like(q, math.nan)
    paged_tree_attention(q, keys[0], values[0], block_table, torch.tensor(prefix_lens), meta,
                         D**-0.5, sliding_window=sliding_window, backend=backend, out=out)
    for b, prefix in enumerate(prefix_lens):
        k, v = (t.double().transpose(0, 1).repeat_interleave(G, 0) for t in logical[b])
        query_pos = prefix + torch.arange(N).view(-1, 1)
        key_pos = torch.arange(prefix + N).view(1, -1)
        mask = key_pos <= query_pos
        if sliding_window is not None:
            mask &= query_pos - key_pos < sliding_window
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[b].double().transpose(0, 1), k, v, attn_mask=mask, scale=D**-0.5
        ).transpose(0, 1)
        assert rel_err(out[b], ref) < 1e-5


# (tree kinds, num_nodes, N, prefix_lens, block_size, layout, Hkv, G, D, window, soft cap)
TREE_CASES = [
    (("random", "forest", "star"), (11, 7, 1), 11, (0, 1, 150), 16, "contiguous", 2, 1, 32, None, None),
    (("forest", "bushy"), (13, 13), 13, (33, 0), 32, "kv_stacked", 1, 2, 64, None, None),
    (("star", "random"), (6, 9), 9, (70, 1), 16, "hnd", 2, 3, 48, None, None),
    (("bushy", "random"), (10, 4), 12, (45, 20), 32, "hnd", 1, 2, 32, 5, None),
    (("random", "chain"), (8, 8), 8, (100, 3), 16, "kv_stacked", 2, 3, 32, None, 5.0),
    (("random", "forest"), (16, 12), 16, (64, 31), 16, "contiguous", 1, 3, 32, 9, 3.0),
    (("random",), (5,), 5, (17,), 16, "hnd", 1, 1, 256, None, None),
    (("random", "star"), (9, 4), 9, (40, 2), 32, "cpu_attn", 2, 2, 64, None, None),
    # Three merge column blocks (MERGE_COLUMNS = 64), the last one partly past D.
    (("bushy", "star"), (12, 5), 12, (50, 0), 16, "hnd", 2, 3, 160, 7, 4.0),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", TREE_CASES, ids=[f"case{i}" for i in range(len(TREE_CASES))])
def test_trees_match_naive(backend, case, gen):
    kinds, num_nodes, N, prefix_lens, bs, layout, Hkv, G, D, window, soft_cap = case
    meta = random_tree_metadata(gen, kinds, N, num_nodes)
    keys, values, block_table, _ = make_paged_batch(
        prefix_lens, num_nodes, Hkv, D, bs, layout, torch.float32, gen
    )
    q = torch.randn(len(kinds), N, Hkv * G, D, generator=gen)
    prefix = torch.tensor(prefix_lens, dtype=torch.int32)
    scale = 0.7 * D**-0.5
    out = torch.full_like(q, math.nan)
    paged_tree_attention(q, keys[0], values[0], block_table, prefix, meta, scale, window,
                         soft_cap, backend=backend, out=out)
    ref = naive_tree_attention(q, keys[0], values[0], block_table, prefix, meta, scale, window,
                               soft_cap)
    assert rel_err(out, ref) < 1e-5
    assert (out[~meta.valid] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_torch_path(dtype, gen):
    # The interpreter's bf16 is unreliable (triton#11584): the Triton kernel's half
    # dtypes are checked on CUDA by tools/bench_kernels.py --only attn.
    num_nodes, prefix_lens = (12, 5), (40, 0)
    meta = random_tree_metadata(gen, ("random", "forest"), 12, num_nodes)
    keys, values, block_table, _ = make_paged_batch(prefix_lens, num_nodes, 2, 64, 16, "hnd",
                                                    dtype, gen)
    q = torch.randn(2, 12, 6, 64, generator=gen).to(dtype)
    prefix = torch.tensor(prefix_lens)
    out = paged_tree_attention(q, keys[0], values[0], block_table, prefix, meta, 0.125,
                               backend="torch")
    assert out.dtype == dtype
    ref = naive_tree_attention(q, keys[0], values[0], block_table, prefix, meta, 0.125)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_commit_moves_the_accepted_path(backend, layout, gen):
    dtype = torch.float32 if backend == "triton" else torch.bfloat16
    num_nodes, prefix_lens, N = (10, 7, 1), (5, 30, 0), 10
    meta = random_tree_metadata(gen, ("random", "forest", "chain"), N, num_nodes)
    keys, values, block_table, _ = make_paged_batch(
        prefix_lens, num_nodes, 2, 16, 16, layout, dtype, gen, num_layers=3
    )
    prefix = torch.tensor(prefix_lens, dtype=torch.int32)
    for node in range(-1, N):
        leaf = torch.tensor([node if node < n else -1 for n in num_nodes])
        got_k, got_v = [k.clone() for k in keys], [v.clone() for v in values]
        tree_kv_commit(got_k, got_v, block_table, prefix, meta, leaf, backend=backend)
        ref_k, ref_v = [k.clone() for k in keys], [v.clone() for v in values]
        naive_tree_kv_commit(ref_k, ref_v, block_table, prefix, meta, leaf)
        # By hand: the path's rows, gathered from the untouched caches, land at
        # prefix + depth; every other row keeps its bits (NaN padding included).
        hand_k, hand_v = [k.clone() for k in keys], [v.clone() for v in values]
        for b in range(len(num_nodes)):
            if leaf[b] < 0:
                continue
            path = meta.ancestors[b, leaf[b]].nonzero().squeeze(1).tolist()
            for depth, j in enumerate(path):
                dst, src = prefix_lens[b] + depth, prefix_lens[b] + j
                for hand, orig in ((hand_k, keys), (hand_v, values)):
                    for layer in range(3):
                        hand[layer][block_table[b, dst // 16], dst % 16] = \
                            orig[layer][block_table[b, src // 16], src % 16]
        for got, ref, hand in ((got_k, ref_k, hand_k), (got_v, ref_v, hand_v)):
            for layer in range(3):
                assert same_bits(got[layer], ref[layer])
                assert same_bits(got[layer], hand[layer])


def test_bad_inputs_name_the_argument(gen, monkeypatch):
    num_nodes, prefix_lens = (4, 3), (10, 0)
    meta = random_tree_metadata(gen, ("chain", "star"), 4, num_nodes)
    keys, values, block_table, _ = make_paged_batch(prefix_lens, num_nodes, 2, 32, 16,
                                                    "contiguous", torch.float32, gen)
    q = torch.randn(2, 4, 4, 32, generator=gen)
    good = dict(q=q, key_cache=keys[0], value_cache=values[0], block_table=block_table,
                prefix_lens=torch.tensor(prefix_lens), meta=meta, scale=0.2)
    bad_cases = {
        "q": q[:, :3],
        "key_cache": keys[0][..., :16],
        "value_cache": values[0].double(),
        "block_table": block_table.float(),
        "prefix_lens": torch.tensor([10, 40]),
        "scale": -1.0,
        "sliding_window": 0,
        "logits_soft_cap": -2.0,
        "backend": "cuda",
        "out": torch.empty(2, 4, 4, 16),
    }
    for name, value in bad_cases.items():
        with pytest.raises(ValueError, match=name):
            paged_tree_attention(**{**good, name: value})
    with pytest.raises(ValueError, match="key_cache"):
        paged_tree_attention(**{**good, "q": torch.randn(2, 4, 3, 32)})  # Hq not a multiple of Hkv

    leaf = torch.tensor([3, 2])
    args = (block_table, torch.tensor(prefix_lens), meta)
    with pytest.raises(ValueError, match="value_caches"):
        tree_kv_commit(keys, [], *args, leaf)
    with pytest.raises(ValueError, match="value_caches"):
        tree_kv_commit(keys, [values[0].to(torch.float64)], *args, leaf)
    with pytest.raises(ValueError, match="accepted_leaf"):
        tree_kv_commit(keys, values, *args, torch.tensor([4, 2]))
    with pytest.raises(ValueError, match="prefix_lens"):
        tree_kv_commit(keys, values, block_table, torch.tensor([10, 60]), meta, leaf)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors.*TRITON_INTERPRET=1"):
        paged_tree_attention(**good, backend="triton")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        tree_kv_commit(keys, values, *args, leaf, backend="triton")


# Memory orders of tiled views, outermost first, over the view's dims (block,
# token tile, token in tile, head, channel tile, channel in tile): like CPU_ATTN's
# AMX keys, its AMX values, and one that no backend uses.
AMX_KEY_ORDER = (0, 3, 1, 4, 2, 5)
AMX_VALUE_ORDER = (0, 3, 4, 1, 5, 2)
ODD_ORDER = (4, 0, 2, 3, 5, 1)


def tiled_copy(cache: torch.Tensor, token_tile: int, channel_tile: int, order) -> torch.Tensor:
    """A tiled [num_blocks, bs / TL, TL, Hkv, D / DL, DL] view holding ``cache``'s
    bits (NaN padding included), over a buffer laid out in ``order``."""
    num_blocks, block_size, Hkv, D = cache.shape
    shape = (num_blocks, block_size // token_tile, token_tile, Hkv, D // channel_tile, channel_tile)
    buffer = torch.empty([shape[dim] for dim in order], dtype=cache.dtype)
    tiled = buffer.permute([order.index(dim) for dim in range(6)])
    tiled.copy_(cache.unflatten(3, shape[4:]).unflatten(1, shape[1:3]))
    return tiled


def untiled(cache: torch.Tensor) -> torch.Tensor:
    return cache.flatten(4, 5).flatten(1, 2)


# (tree kinds, num_nodes, prefix_lens, block_size, Hkv, G, D, dtype, window, soft cap,
#  key tiles (TL, DL, order), value tiles)
TILED_CASES = [
    (("random", "star"), (9, 4), (40, 2), 32, 2, 2, 64, torch.bfloat16, None, None,
     (16, 2, AMX_KEY_ORDER), (2, 16, AMX_VALUE_ORDER)),
    (("forest", "bushy", "chain"), (13, 6, 1), (0, 70, 33), 64, 1, 3, 128, torch.bfloat16, 7, None,
     (16, 2, AMX_KEY_ORDER), (2, 16, AMX_VALUE_ORDER)),
    (("random",), (16,), (100,), 16, 3, 1, 32, torch.float32, None, 4.0,
     (4, 8, ODD_ORDER), (16, 32, AMX_KEY_ORDER)),
]


@pytest.mark.parametrize("case", TILED_CASES, ids=[f"case{i}" for i in range(len(TILED_CASES))])
def test_tiled_caches_match_plain(case, gen):
    kinds, num_nodes, prefix_lens, bs, Hkv, G, D, dtype, window, soft_cap = case[:10]
    key_tiles, value_tiles = case[10:]
    N = max(num_nodes)
    meta = random_tree_metadata(gen, kinds, N, num_nodes)
    keys, values, block_table, _ = make_paged_batch(prefix_lens, num_nodes, Hkv, D, bs,
                                                    "contiguous", dtype, gen, num_layers=2)
    tiled_k = [tiled_copy(k, *key_tiles) for k in keys]
    tiled_v = [tiled_copy(v, *value_tiles) for v in values]
    prefix = torch.tensor(prefix_lens, dtype=torch.int32)
    q = torch.randn(len(kinds), N, Hkv * G, D, generator=gen).to(dtype)
    args = (block_table, prefix, meta, 0.8 * D**-0.5, window, soft_cap)
    plain = paged_tree_attention(q, keys[0], values[0], *args, backend="torch")
    tiled = paged_tree_attention(q, tiled_k[0], tiled_v[0], *args, backend="torch")
    assert torch.equal(tiled, plain)

    for node in (-1, 0, N // 2, N - 1):
        leaf = torch.tensor([node if node < n else n - 1 for n in num_nodes])
        got_k, got_v = [k.clone() for k in tiled_k], [v.clone() for v in tiled_v]
        ref_k, ref_v = [k.clone() for k in keys], [v.clone() for v in values]
        tree_kv_commit(got_k, got_v, block_table, prefix, meta, leaf, backend="torch")
        tree_kv_commit(ref_k, ref_v, block_table, prefix, meta, leaf, backend="torch")
        for got, ref in zip(got_k + got_v, ref_k + ref_v):
            assert same_bits(untiled(got), ref)


def test_triton_refuses_tiled_caches(gen):
    num_nodes, prefix_lens = (4, 3), (10, 0)
    meta = random_tree_metadata(gen, ("chain", "star"), 4, num_nodes)
    keys, values, block_table, _ = make_paged_batch(prefix_lens, num_nodes, 2, 32, 16,
                                                    "contiguous", torch.float32, gen)
    tiled_k = tiled_copy(keys[0], 16, 2, AMX_KEY_ORDER)
    tiled_v = tiled_copy(values[0], 2, 16, AMX_VALUE_ORDER)
    q = torch.randn(2, 4, 4, 32, generator=gen)
    args = (block_table, torch.tensor(prefix_lens), meta)
    for key_cache, value_cache, name in ((tiled_k, values[0], "key_cache"),
                                         (keys[0], tiled_v, "value_cache")):
        with pytest.raises(ValueError, match=f"{name} must be a plain .* CPU-only"):
            paged_tree_attention(q, key_cache, value_cache, *args, 0.2, backend="triton")
    leaf = torch.tensor([3, 2])
    with pytest.raises(ValueError, match=r"value_caches\[0\] must be a plain .* CPU-only"):
        tree_kv_commit(keys, [tiled_v], *args, leaf, backend="triton")


@pytest.mark.parametrize("num_sms", [132, 114, 78, 264])
def test_split_count_fills_whole_waves(num_sms):
    """Long prefixes: the split kernel's programs come in whole waves of the SMs'
    slots, e.g. 24 programs per split on 132 SMs (B = 1, N = 128 at Qwen3.6-27B's
    attention shapes) take 11 splits = 2 full waves, not 6 = 1.1 waves; and many
    programs per split need no splitting (B = 32: 768 programs, one split)."""
    for per_split in range(1, 800):
        splits = split_count(per_split, num_sms)
        assert 1 <= splits <= MAX_SPLITS
        programs = per_split * splits
        fill = programs / (math.ceil(programs / num_sms) * num_sms)
        # With too few programs even MAX_SPLITS splits cannot fill one wave.
        best_possible = min(1.0, per_split * MAX_SPLITS / num_sms)
        assert fill >= min(0.9, best_possible) / SPLIT_TOLERANCE, (per_split, splits, fill)
    assert split_count(24, 132) == 11
    assert split_count(12, 132) == 11
    assert split_count(768, 132) == 1


def test_tile_height_takes_the_cheaper_tiles():
    """Row tiles of 128 unless 64-row tiles cost less at 1.5 a 128-row tile: the engine's
    65-node tree (G = 6, 390 rows) takes four 128-row tiles, not seven of 64; small trees
    and fp32 inputs take 64."""
    assert tile_height(390, 2) == 128  # 4 x 1.5 = 6 < 7
    assert tile_height(192, 2) == 128  # 3 = 3: the tie goes to 128
    assert tile_height(48, 2) == 64  # 1.5 > 1
    assert tile_height(6, 2) == 64
    assert tile_height(390, 4) == 64  # fp32: a 128-row Q tile would not fit beside K / V
    for rows in range(1, 800):
        costs = {height: math.ceil(rows / height) * TILE_COST[height] for height in (64, 128)}
        assert costs[tile_height(rows, 2)] == min(costs.values()), rows


def random_case(gen):
    """Random shapes for the kernel-parameter test: (kinds, num_nodes, N, prefixes,
    block size, layout, Hkv, G, D, window, soft cap), drawn from ``gen``."""
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    B = pick([1, 2, 3])
    N = pick([1, 3, 7, 16, 21])
    num_nodes = [N] + [int(torch.randint(1, N + 1, (1,), generator=gen)) for _ in range(B - 1)]
    prefixes = [pick([0, 1, 15, 16, 17, 40, 97, 130]) for _ in range(B)]
    kinds = [pick(["random", "forest", "star", "chain", "bushy"]) for _ in range(B)]
    return (kinds, num_nodes, N, prefixes, pick([16, 32]), pick(["contiguous", "hnd", "kv_stacked"]),
            pick([1, 2]), pick([1, 3, 6]), pick([16, 32, 48]), pick([None, None, 1, 7, 50]),
            pick([None, None, 2.0]))


# (block_m, block_n, num_warps, num_stages, min_chunk, num_splits, per_sm, rescale_slack)
CONFIGS = [
    (16, 16, 4, 1, 16, 1, 1, 8.0),
    (32, 16, 4, 1, 32, 4, 1, 8.0),
    (16, 32, 4, 1, 32, 2, 1, 0.0),
    (64, 16, 4, 1, 16, 5, 1, -1.0),
    # Past the merge kernel's partials in flight (MERGE_SPLITS_IN_FLIGHT = 16): its split
    # loop runs again, the last round partly past num_splits.
    (16, 16, 4, 1, 16, 16, 1, 8.0),
    (16, 16, 4, 1, 16, 17, 1, 8.0),
    (32, 16, 4, 1, 16, 40, 1, 8.0),
]


@pytest.mark.parametrize("config", CONFIGS, ids=[f"config{i}" for i in range(len(CONFIGS))])
@pytest.mark.parametrize("draw", range(3))
def test_kernel_parameters_match_naive(config, draw, gen):
    """The kernels under explicit tiles, split counts and rescale rules on random
    shapes (seed printed): idle splits, partial last tiles, padded rows, windows."""
    kinds, num_nodes, N, prefix_lens, bs, layout, Hkv, G, D, window, soft_cap = random_case(gen)
    print(f"case: {kinds} nodes={num_nodes} N={N} prefixes={prefix_lens} bs={bs} {layout} "
          f"Hkv={Hkv} G={G} D={D} window={window} cap={soft_cap}")
    meta = random_tree_metadata(gen, kinds, N, num_nodes)
    keys, values, block_table, _ = make_paged_batch(prefix_lens, num_nodes, Hkv, D, bs, layout,
                                                    torch.float32, gen)
    q = torch.randn(len(kinds), N, Hkv * G, D, generator=gen)
    prefix = torch.tensor(prefix_lens, dtype=torch.int32)
    scale = 0.9 * D**-0.5
    out = torch.full_like(q, math.nan)
    launch_tree_attention(q, keys[0], values[0], block_table, prefix, meta, scale, window,
                          soft_cap, out, KernelConfig(*config))
    ref = naive_tree_attention(q, keys[0], values[0], block_table, prefix, meta, scale, window,
                               soft_cap)
    assert rel_err(out, ref) < 1e-5
    assert (out[~meta.valid] == 0).all()


def test_one_merge_kernel_serves_every_split_count(gen):
    """The merge kernel takes the split count at run time and Triton does not specialise
    it: launches for 3 and 41 splits carry the same constexprs, so one compiled kernel
    serves both (a kernel per count compiled 2-12 s each as batches of new shapes came)."""
    from triton_ops.testing import recording_launches
    from triton_ops.tree_attention.attention import _tree_attention_merge_kernel

    assert "num_splits" in _tree_attention_merge_kernel.kwargs["do_not_specialize"]
    meta = random_tree_metadata(gen, ["random"], 5, [5])
    keys, values, block_table, _ = make_paged_batch([40], [5], 1, 32, 16, "contiguous",
                                                    torch.float32, gen)
    q = torch.randn(1, 5, 2, 32, generator=gen)
    merges = []
    for splits in (3, 41):
        with recording_launches() as launches:
            launch_tree_attention(q, keys[0], values[0], block_table,
                                  torch.tensor([40], dtype=torch.int32), meta, 0.5, None, None,
                                  torch.empty_like(q), KernelConfig(16, 16, 4, 1, 16, splits))
        (args, constexprs), = [(a, k) for fn, a, k in launches
                               if fn.__name__ == "_tree_attention_merge_kernel"]
        assert splits in [a for a in args if isinstance(a, int)]
        merges.append(constexprs)
    assert merges[0] == merges[1]


@pytest.mark.parametrize("slack", [8.0, 0.0, -1.0])
def test_sharp_softmax_rescales_late(slack, gen):
    """Logits spread over hundreds of log2 units, the largest ones late in each
    split: the running maximum jumps past the slack mid-prefix and the stale-maximum
    sums must rescale exactly; also exercises probabilities up to 2^slack."""
    B, N, Hkv, G, D, bs = 2, 6, 1, 3, 32, 16
    prefix_lens, num_nodes = [150, 61], [6, 4]
    meta = random_tree_metadata(gen, ["random", "chain"], N, num_nodes)
    keys, values, block_table, _ = make_paged_batch(prefix_lens, num_nodes, Hkv, D, bs,
                                                    "contiguous", torch.float32, gen)
    # Keys grow along the prefix, so later tiles hold larger logits.
    for b, prefix in enumerate(prefix_lens):
        pos = torch.arange(prefix)
        blk, off = block_table[b, pos // bs].long(), pos % bs
        keys[0][blk, off] *= (1.0 + pos / 10.0).view(-1, 1, 1)
    q = 3.0 * torch.randn(B, N, Hkv * G, D, generator=gen)
    prefix = torch.tensor(prefix_lens, dtype=torch.int32)
    out = torch.full_like(q, math.nan)
    launch_tree_attention(q, keys[0], values[0], block_table, prefix, meta, 0.5, None, None, out,
                          KernelConfig(16, 16, 4, 1, 16, 3, 1, slack))
    ref = naive_tree_attention(q, keys[0], values[0], block_table, prefix, meta, 0.5)
    assert rel_err(out, ref) < 1e-5
