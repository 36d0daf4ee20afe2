"""Weaver: tree-KV rounds against a float64 full-sequence reference, batching, checkpoints."""

import json
import math
import random
from pathlib import Path

import pytest
import torch

from vllm_tfm.drafting.weaver import WeaverConfig
from vllm_tfm.drafting.weaver_checkpoint import (
    SPECULATOR_KIND,
    load_weaver,
    random_weaver,
    save_weaver_public,
    save_weaver_safetensors,
)

D_MODEL, D_EMBED, D_RANK, HEADS, MLP, VOCAB, POOL = 64, 48, 32, 2, 40, 300, 16
LAYOUTS = ["learned_pos", "rope_swiglu"]


def make_config(layout, K=6, num_layers=2, **extra):
    return WeaverConfig(
        d_model=D_MODEL, d_embed=D_EMBED, d_rank=D_RANK, num_layers=num_layers,
        num_heads=HEADS, mlp_dim=MLP, K=K, candidate_pool_size=POOL, layout=layout,
        extra=extra,
    )


def make_target(seed):
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, D_EMBED, generator=gen)
    return embed, torch.randn(VOCAB, D_MODEL, generator=gen) / 8


def make_round_inputs(rows, depth, seed, pool=POOL):
    gen = torch.Generator().manual_seed(seed)
    h_v = 3.0 * torch.randn(rows, D_MODEL, generator=gen)
    hidden = 3.0 * torch.randn(rows, depth, D_MODEL, generator=gen)
    ids = torch.randint(0, VOCAB, (rows, depth, pool), generator=gen)
    scores = 3.0 * torch.randn(rows, depth, pool, generator=gen)
    return h_v, hidden, ids, scores


# ---------------------------------------------------------------- float64 reference
# Written from the parameter names alone, sharing no code with the module: the whole
# sequence [h_v; H_1..H_D; root..node tokens] runs causally (the prefix rows see only
# earlier prefix rows; path rows see the whole prefix and earlier path rows).


def _norm(sd, name, x, eps=1e-6):
    normed = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return normed * sd[f"{name}.weight"] + sd[f"{name}.bias"]


def _lin(sd, name, x):
    out = x @ sd[f"{name}.weight"].T
    return out + sd[f"{name}.bias"] if f"{name}.bias" in sd else out


def _rope(t, positions, theta):
    # Pairs (i, i + hd/2) rotate by positions * theta^(-2i/hd): a complex product.
    half = t.shape[-1] // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / t.shape[-1])
    angles = positions[:, None] * freq
    turn = torch.polar(torch.ones_like(angles), angles)
    z = torch.complex(t[..., :half], t[..., half:]) * turn[:, None, :]
    return torch.cat([z.real, z.imag], -1)


def reference_path_logq(sd, cfg, h_v, hidden, pool_ids, pool_scores, embed, lm_head, path):
    """log q over the pool of each path node's next depth: [len(path), P] float64."""
    depth, length, hd = hidden.shape[0], len(path), cfg.head_dim
    states = torch.cat([h_v[None], hidden]).double()
    x = torch.cat([
        _lin(sd, "proposal_in", _norm(sd, "output_norm", states)),
        _lin(sd, "token_in", _norm(sd, "embed_norm", embed.double()[path])),
    ])
    positions = torch.cat([torch.arange(depth + 1), torch.arange(1, length + 1)]).double()
    if cfg.layout == "learned_pos":
        x[1:] = x[1:] + sd["pos_emb"][positions[1:].long() - 1]
    total = depth + 1 + length
    i, j = torch.arange(total)[:, None], torch.arange(total)[None, :]
    allowed = (j <= i) | ((i > depth) & (j <= depth))
    for b in range(cfg.num_layers):
        p = f"blocks.{b}"
        h = _norm(sd, f"{p}.norm_attn", x)
        if cfg.layout == "learned_pos":
            q, k, v = (_lin(sd, f"{p}.{n}_proj", h).view(total, HEADS, hd) for n in "qkv")
        else:
            q, k, v = _lin(sd, f"{p}.qkv_proj", h).view(total, 3, HEADS, hd).unbind(1)
            q, k = _rope(q, positions, cfg.rope_theta), _rope(k, positions, cfg.rope_theta)
        scores = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(hd)
        attn = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
        x = x + _lin(sd, f"{p}.o_proj", torch.einsum("hij,jhd->ihd", attn, v).reshape(total, -1))
        h = _norm(sd, f"{p}.norm_mlp", x)
        if cfg.layout == "learned_pos":
            a = _lin(sd, f"{p}.fc1", h)
            x = x + _lin(sd, f"{p}.fc2", 0.5 * a * (1 + torch.erf(a / math.sqrt(2))))
        else:
            gate, up = _lin(sd, f"{p}.gate_up_proj", h).chunk(2, -1)
            x = x + _lin(sd, f"{p}.down_proj", gate * torch.sigmoid(gate) * up)
    y = _norm(sd, "out_norm", x[depth + 1:])
    w_q = lm_head.double() @ sd["lm_head_query_in.weight"]
    rows = min(length, depth)
    residual = torch.einsum("lpd,ld->lp", w_q[pool_ids[:rows]], y[:rows])
    logits = pool_scores[:rows].double() + residual
    return logits - torch.logsumexp(logits, -1, keepdim=True)


# ---------------------------------------------------------------- random trees


class TreePlan:
    """Random expand calls for R requests; remembers every node to rebuild its path."""

    def __init__(self, rows, depth, max_nodes, width, shape, seed):
        self.rng = random.Random(seed)
        self.rows, self.depth, self.width, self.shape = rows, depth, width, shape
        self.free = [self.rng.sample(range(max_nodes), max_nodes) for _ in range(rows)]
        self.nodes = [{} for _ in range(rows)]  # index -> (parent, depth, token)

    def next_call(self):
        call = torch.full((4, self.rows, self.width), -1, dtype=torch.int64)
        call[1] = 0
        for r in range(self.rows):
            nodes = self.nodes[r]
            expandable = [i for i, (_, d, _) in nodes.items() if d < self.depth]
            if not nodes:
                parents = [-1] * (2 if self.shape == "forest" else 1)
            elif self.shape == "chain":
                parents = [max(nodes, key=lambda i: nodes[i][1])] if expandable else []
            elif self.shape == "star":
                parents = [next(i for i, v in nodes.items() if v[0] == -1)] * self.width
            else:
                count = self.rng.randint(0, self.width)
                parents = [self.rng.choice(expandable) for _ in range(count)] if expandable else []
            parents = parents[: min(self.width, len(self.free[r]))]
            slots = self.rng.sample(range(self.width), len(parents))
            added = {}
            for slot, parent in zip(slots, parents):
                index = self.free[r].pop()
                depth = 0 if parent < 0 else nodes[parent][1] + 1
                token = self.rng.randrange(VOCAB)
                added[index] = (parent, depth, token)
                call[:, r, slot] = torch.tensor([index, token, parent, depth])
            nodes.update(added)  # parents must come from earlier calls
        return call

    def path(self, r, index):
        tokens = []
        while index >= 0:
            parent, _, token = self.nodes[r][index]
            tokens.append(token)
            index = parent
        return tokens[::-1]


def run_plan(weaver, inputs, plan, max_nodes, calls):
    session = weaver.start_round(*inputs, max_nodes=max_nodes)
    outs = []
    for _ in range(calls):
        call = plan.next_call()
        outs.append((call, session.expand(*call)))
    return session, outs


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "shape, rows, depth, width, calls",
    [
        ("random", 3, 6, 4, 6),
        ("random", 2, 4, 1, 8),
        ("chain", 2, 6, 2, 7),
        ("star", 1, 3, 5, 3),
        ("forest", 2, 5, 3, 5),
    ],
)
def test_tree_round_matches_full_sequence_reference(layout, shape, rows, depth, width, calls):
    seed = random.randrange(2**31)
    cfg = make_config(layout)
    weaver = random_weaver(cfg, seed)
    embed, lm_head = make_target(seed + 1)
    weaver.prepare_tables(embed, lm_head)
    inputs = make_round_inputs(rows, depth, seed + 2)
    max_nodes = 1 + width * calls
    plan = TreePlan(rows, depth, max_nodes, width, shape, seed + 3)
    _, outs = run_plan(weaver, inputs, plan, max_nodes, calls)
    sd = {k: v.double() for k, v in weaver.state_dict().items()}
    worst, checked = 0.0, 0
    for call, logq in outs:
        assert logq.shape == (rows, width, POOL) and logq.dtype == torch.float32
        assert not torch.isnan(logq).any()
        for r in range(rows):
            for j in range(width):
                index, _, _, node_depth = call[:, r, j].tolist()
                if index < 0 or node_depth == depth:
                    assert torch.all(logq[r, j] == float("-inf")), f"seed {seed}: row must be -inf"
                    continue
                ref = reference_path_logq(
                    sd, cfg, inputs[0][r], inputs[1][r], inputs[2][r], inputs[3][r],
                    embed, lm_head, plan.path(r, index),
                )[-1]
                err = ((logq[r, j].double() - ref).norm() / ref.norm()).item()
                worst, checked = max(worst, err), checked + 1
    assert checked > 0
    assert worst < 1e-5, f"seed {seed}: worst relative error {worst:.2e}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batched_round_equals_one_request_at_a_time(layout):
    seed = random.randrange(2**31)
    rows, depth, width, calls = 4, 5, 3, 5
    weaver = random_weaver(make_config(layout), seed)
    weaver.prepare_tables(*make_target(seed + 1))
    inputs = make_round_inputs(rows, depth, seed + 2)
    max_nodes = 1 + width * calls
    plan = TreePlan(rows, depth, max_nodes, width, "random", seed + 3)
    _, outs = run_plan(weaver, inputs, plan, max_nodes, calls)
    for r in range(rows):
        single = weaver.start_round(*(t[r : r + 1] for t in inputs), max_nodes=max_nodes)
        for call, logq in outs:
            got = single.expand(*call[:, r : r + 1])
            torch.testing.assert_close(got, logq[r : r + 1], atol=1e-5, rtol=0, msg=f"seed {seed}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_on_the_cuda_path_equals_the_torch_path(layout, monkeypatch):
    """Every op on its kernel (in the interpreter), as on CUDA: each block's MLP output is
    added inside the next norm (two blocks here, then out_norm), the same scores as the
    PyTorch path's separate adds."""
    from host_reads import run_as_on_cuda

    seed = random.randrange(2**31)
    rows, depth, width, calls = 2, 5, 3, 4
    weaver = random_weaver(make_config(layout, num_layers=2), seed)
    weaver.prepare_tables(*make_target(seed + 1))
    inputs = make_round_inputs(rows, depth, seed + 2)
    max_nodes = 1 + width * calls
    plan = TreePlan(rows, depth, max_nodes, width, "random", seed + 3)
    _, expected = run_plan(weaver, inputs, plan, max_nodes, calls)
    run_as_on_cuda(monkeypatch)
    session = weaver.start_round(*inputs, max_nodes=max_nodes)
    for call, want in expected:
        torch.testing.assert_close(session.expand(*call), want, atol=1e-5, rtol=0, msg=f"seed {seed}")


def test_unvalidated_round_gives_the_same_scores():
    """The engine's rounds skip the host-side node checks; the numbers must not change."""
    seed = random.randrange(2**31)
    rows, depth, width, calls = 3, 5, 3, 5
    weaver = random_weaver(make_config("rope_swiglu"), seed)
    weaver.prepare_tables(*make_target(seed + 1))
    inputs = make_round_inputs(rows, depth, seed + 2)
    max_nodes = 1 + width * calls
    plan = TreePlan(rows, depth, max_nodes, width, "random", seed + 3)
    _, outs = run_plan(weaver, inputs, plan, max_nodes, calls)
    fast = weaver.start_round(*inputs, max_nodes=max_nodes, validate=False)
    for call, logq in outs:
        assert torch.equal(fast.expand(*call), logq), f"seed {seed}"


def test_bf16_round_tracks_fp32():
    seed = random.randrange(2**31)
    weaver = random_weaver(make_config("rope_swiglu"), seed)
    target = make_target(seed + 1)
    inputs = make_round_inputs(2, 4, seed + 2)
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        weaver = weaver.to(dtype)
        weaver.prepare_tables(*target)
        plan = TreePlan(2, 4, 9, 2, "random", seed + 3)
        outs.append(torch.stack([logq for _, logq in run_plan(weaver, inputs, plan, 9, 4)[1]]))
    assert outs[1].dtype == torch.float32
    finite = torch.isfinite(outs[0])
    assert torch.equal(finite, torch.isfinite(outs[1]))
    probs = [o[finite].exp() for o in outs]
    assert (probs[1] - probs[0]).abs().max().item() < 0.02, f"seed {seed}"


def test_padding_and_last_depth_rows_write_nothing():
    weaver = random_weaver(make_config("rope_swiglu", K=2), 5)
    weaver.prepare_tables(*make_target(6))
    session = weaver.start_round(*make_round_inputs(2, 2, 7), max_nodes=4)
    # Request 0: root, child, grandchild (depth 2 = D: no next pool). Request 1: padding only.
    steps = [(0, -1), (1, 0), (2, 1)]  # (node index, parent) of request 0 at depth 0, 1, 2
    for depth, (index, parent) in enumerate(steps):
        before = (session.node_keys.clone(), session.node_depth.clone())
        logq = session.expand(  # request 1's padding row holds garbage on purpose
            torch.tensor([[index], [-1]]), torch.tensor([[7], [123456]]),
            torch.tensor([[parent], [99]]), torch.tensor([[depth], [99]]),
        )
        assert torch.all(logq[1] == float("-inf"))
        assert torch.isfinite(logq[0]).all() == (depth < 2)
        # Only request 0's new node and the scratch slot may change.
        changed = (session.node_keys != before[0]).flatten(3).any(-1).any(0)  # [R, N+1]
        allowed = torch.zeros_like(changed)
        allowed[0, index] = depth < 2
        allowed[:, -1] = True
        assert not (changed & ~allowed).any()
        assert torch.equal(session.node_depth[1, :-1], before[1][1, :-1])
    assert session.node_depth[0, :3].tolist() == [0, 1, 2]


def _ok_round(depth=3, max_nodes=6):
    weaver = random_weaver(make_config("learned_pos", K=4), 11)
    weaver.prepare_tables(*make_target(12))
    session = weaver.start_round(*make_round_inputs(2, depth, 13), max_nodes=max_nodes)
    session.expand(*torch.tensor([[[0], [0]], [[1], [2]], [[-1], [-1]], [[0], [0]]]))
    return weaver, session


@pytest.mark.parametrize(
    "call, match",
    [
        ([[[1], [6]], [[1], [1]], [[0], [0]], [[1], [1]]], "node_index must be -1 or in"),
        ([[[0], [1]], [[1], [1]], [[0], [0]], [[1], [1]]], "already used"),
        ([[[1, 1], [1, 2]], [[1, 1], [1, 1]], [[0, 0], [0, 0]], [[1, 1], [1, 1]]], "appears twice"),
        ([[[1], [1]], [[1], [300]], [[0], [0]], [[1], [1]]], "tokens must lie"),
        ([[[1], [1]], [[1], [1]], [[0], [3]], [[1], [1]]], "no earlier expand call"),
        # A parent added in the same call does not count.
        ([[[1, 2], [1, 2]], [[1, 1], [1, 1]], [[0, 1], [0, 0]], [[1, 2], [1, 1]]], "no earlier"),
        ([[[1], [1]], [[1], [1]], [[0], [0]], [[2], [1]]], "the parent.s \\+ 1"),
        ([[[1], [1]], [[1], [1]], [[-1], [0]], [[1], [1]]], "root"),
        ([[[1], [1]], [[1], [1]], [[0], [-2]], [[1], [1]]], "parent_index must be -1 or in"),
    ],
)
def test_expand_rejects_inconsistent_nodes(call, match):
    _, session = _ok_round()
    with pytest.raises(ValueError, match=match):
        session.expand(*torch.tensor(call))


def test_expand_rejects_children_past_depth_d():
    _, session = _ok_round(depth=1)
    session.expand(*torch.tensor([[[1], [1]], [[1], [1]], [[0], [0]], [[1], [1]]]))
    with pytest.raises(ValueError, match="at most D=1"):
        session.expand(*torch.tensor([[[2], [2]], [[1], [1]], [[1], [1]], [[2], [2]]]))


def test_expand_rejects_bad_shapes():
    _, session = _ok_round()
    with pytest.raises(ValueError, match="tokens must be an int64"):
        node_index, tokens, parents, depths = torch.tensor(
            [[[1], [1]], [[1], [1]], [[0], [0]], [[1], [1]]]
        )
        session.expand(node_index, tokens.int(), parents, depths)
    with pytest.raises(ValueError, match=r"node_index must be an int64 \[R=2"):
        session.expand(*torch.zeros(4, 3, 1, dtype=torch.int64))


def test_start_round_and_tables_reject_bad_arguments():
    weaver = random_weaver(make_config("rope_swiglu", K=4), 1)
    h_v, hidden, ids, scores = make_round_inputs(2, 4, 2)
    with pytest.raises(ValueError, match="prepare_tables"):
        weaver.start_round(h_v, hidden, ids, scores, max_nodes=4)
    embed, lm_head = make_target(3)
    with pytest.raises(ValueError, match="lm_head_weight has"):
        weaver.prepare_tables(embed, lm_head[:-1])
    with pytest.raises(ValueError, match="d_model"):
        weaver.prepare_tables(embed, lm_head[:, :-1])
    weaver.vocab_size = VOCAB + 1
    with pytest.raises(ValueError, match="target_vocab_size"):
        weaver.prepare_tables(embed, lm_head)
    weaver.vocab_size = VOCAB
    weaver.prepare_tables(embed, lm_head)
    bad = {
        "D must be in": (h_v, make_round_inputs(2, 5, 2)[1], ids, scores, 4),
        "pool size P": (h_v, hidden, *make_round_inputs(2, 4, 2, pool=POOL + 1)[2:], 4),
        r"pool_ids must lie in \[0, V=300\)": (h_v, hidden, ids.clone().fill_(VOCAB), scores, 4),
        "max_nodes": (h_v, hidden, ids, scores, 0),
        "h_v must be": (h_v[:, :-1], hidden, ids, scores, 4),
        "pool_scores must be": (h_v, hidden, ids, scores[..., :-1], 4),
    }
    for match, args in bad.items():
        with pytest.raises(ValueError, match=match):
            weaver.start_round(*args[:4], max_nodes=args[4])


def test_prepare_tables_match_float64_definition():
    weaver = random_weaver(make_config("learned_pos"), 21)
    embed, lm_head = make_target(22)
    weaver.prepare_tables(embed, lm_head)
    sd = {k: v.double() for k, v in weaver.state_dict().items()}
    w_q = lm_head.double() @ sd["lm_head_query_in.weight"]
    e_prime = _lin(sd, "token_in", _norm(sd, "embed_norm", embed.double()))
    for got, ref in ((weaver.query_table, w_q), (weaver.token_table, e_prime)):
        assert got.shape == (VOCAB, D_RANK) and got.dtype == torch.float32
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-6


# ---------------------------------------------------------------- checkpoints


def _same_outputs(a, b, seed):
    target = make_target(seed)
    inputs = make_round_inputs(2, 3, seed + 1)
    outs = []
    for weaver in (a, b):
        weaver.prepare_tables(*target)
        session = weaver.start_round(*inputs, max_nodes=3)
        root = session.expand(*torch.tensor([[[0], [0]], [[4], [9]], [[-1], [-1]], [[0], [0]]]))
        child = session.expand(*torch.tensor([[[1], [1]], [[8], [2]], [[0], [0]], [[1], [1]]]))
        outs.append(torch.cat([root, child], 1))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def _public_payload(weaver):
    """Exactly the structure the public tooling writes, built by hand."""
    cfg = weaver.config
    config = {
        "d_model": cfg.d_model, "d_embed": cfg.d_embed, "d_rank": cfg.d_rank,
        "num_layers": cfg.num_layers, "num_heads": cfg.num_heads, "mlp_dim": cfg.mlp_dim,
        "K": cfg.K, "candidate_pool_size": cfg.candidate_pool_size,
        "encoder_mode": 3, "score_head": 4,
    }
    if cfg.layout == "rope_swiglu":
        config.update(activation="swiglu", rope_base=10_000.0)
    return {
        "config": config,
        "state_dict": {k: v.clone() for k, v in weaver.state_dict().items()},
        "metadata": {"speculator_kind": "dflash_tfm_weaver", "target_model": "tiny", "step": 100},
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpoint_round_trips(layout, tmp_path):
    seed = random.randrange(2**31)
    weaver = random_weaver(make_config(layout, note="kept"), seed)
    # Public tooling's own file.
    torch.save(_public_payload(weaver), tmp_path / "public.pth")
    loaded = load_weaver(
        tmp_path / "public.pth", target_hidden_size=D_MODEL, target_vocab_size=VOCAB
    )
    assert loaded.config.layout == layout and loaded.config.extra["encoder_mode"] == 3
    _same_outputs(weaver, loaded, seed)
    # Our writers, both formats; unknown config keys survive.
    save_weaver_public(weaver, tmp_path / "ours.pth", metadata={"run": "t"})
    save_weaver_safetensors(weaver, tmp_path / "dir", metadata={"run": "t"})
    for path in (tmp_path / "ours.pth", tmp_path / "dir"):
        again = load_weaver(path)
        assert again.config == weaver.config
        for key, value in weaver.state_dict().items():
            assert torch.equal(again.state_dict()[key], value), key
        _same_outputs(weaver, again, seed)
    public = torch.load(tmp_path / "ours.pth", weights_only=True)
    assert set(public) == {"config", "state_dict", "metadata"}
    assert public["metadata"] == {"run": "t", "speculator_kind": SPECULATOR_KIND}
    assert "layout" not in public["config"]
    assert json.loads((tmp_path / "dir" / "config.json").read_text())["config"]["layout"] == layout
    half = load_weaver(tmp_path / "dir", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())


def _record_unpickle(marker):
    Path(marker).write_text("unpickled")


class _Sneaky:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (_record_unpickle, (self.marker,))


def _mutated(tmp_path, mutate, name="bad.pth"):
    payload = _public_payload(random_weaver(make_config("learned_pos"), 3))
    mutate(payload)
    torch.save(payload, tmp_path / name)
    return tmp_path / name


def _drop(field, key):
    return lambda p: p[field].pop(key)


def _set(field, **values):
    return lambda p: p[field].update(values)


def _tensor(key, value):
    return lambda p: p["state_dict"].update({key: value})


@pytest.mark.parametrize(
    "mutate, match",
    [
        (_drop("state_dict", "blocks.1.fc2.bias"), r"missing keys \['blocks.1.fc2.bias'\]"),
        (_tensor("blocks.0.extra.weight", torch.zeros(2)), r"unexpected keys \['blocks.0.extra"),
        (_tensor("blocks.0.qkv_proj.weight", torch.zeros(2)), "exactly one block layout"),
        (_drop("state_dict", "blocks.0.q_proj.weight"), "exactly one block layout"),
        (_tensor("pos_emb", torch.zeros(7, D_RANK)), r"\['pos_emb'\] has shape \[7, 32\]"),
        (_tensor("token_in.bias", torch.zeros(D_RANK, dtype=torch.int64)), "must be a float"),
        (_set("metadata", speculator_kind="eagle3"), "must be 'dflash_tfm_weaver', got 'eagle3'"),
        (lambda p: p.pop("metadata"), "field 'metadata' must be a dict"),
        (lambda p: p.update(extra_field=1), "unexpected top-level fields"),
        (_drop("config", "d_rank"), r"missing required keys \['d_rank'\]"),
        (_set("config", K=0), r"config.K must be a positive integer"),
        (_set("config", K=1000), r"config.K \(max tree depth\) must be in"),
        (_set("config", candidate_pool_size=0), "config.candidate_pool_size must be"),
        (_set("config", encoder_mode=1), "config.encoder_mode must be"),
        (_set("config", activation="swiglu"), "config.activation must be 'gelu'"),
        (_set("config", layout="rope_swiglu"), "config.layout is 'rope_swiglu'"),
    ],
)
def test_load_rejects_bad_checkpoints(tmp_path, mutate, match):
    with pytest.raises(ValueError, match=match):
        load_weaver(_mutated(tmp_path, mutate))


def test_load_refuses_pickles_beyond_weights_only(tmp_path):
    marker = tmp_path / "marker.txt"
    path = _mutated(tmp_path, lambda p: p["metadata"].update(sneaky=_Sneaky(str(marker))))
    with pytest.raises(ValueError, match="refused: torch.load\\(weights_only=True\\)"):
        load_weaver(path)
    assert not marker.exists()
    # A file that is no torch checkpoint at all is refused the same way.
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="refused"):
        load_weaver(tmp_path / "junk.pth")


def test_load_checks_target_and_paths(tmp_path):
    path = _mutated(tmp_path, lambda p: None, name="ok.pth")
    with pytest.raises(ValueError, match="config.d_model = 64 but the target hidden size is 128"):
        load_weaver(path, target_hidden_size=128)
    weaver = load_weaver(path, target_vocab_size=VOCAB + 5)
    with pytest.raises(ValueError, match="target_vocab_size=305"):
        weaver.prepare_tables(*make_target(0))
    with pytest.raises(ValueError, match="neither a checkpoint file nor a directory"):
        load_weaver(tmp_path / "absent.pth")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="needs config.json"):
        load_weaver(tmp_path / "empty")
    with pytest.raises(ValueError, match="speculator_kind must be"):
        save_weaver_public(weaver, tmp_path / "x.pth", metadata={"speculator_kind": "dflash"})


def test_random_weaver_is_deterministic():
    cfg = make_config("learned_pos")
    a, b, c = random_weaver(cfg, 4), random_weaver(cfg, 4), random_weaver(cfg, 5)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key])
    assert not torch.equal(a.token_in.weight, c.token_in.weight)
