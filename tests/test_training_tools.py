"""Training and evaluation (vllm_tfm/training/, the library of tools/train_*.py and
tools/eval_acceptance.py): the LK loss against a float64 hand computation, Weaver teacher forcing
against the inference path, DFlash block masking, exact target scoring, overfitting a
tiny batch, each tool end to end on the tiny family (loadable outputs, resume), and
eval's tau against a hand count."""

import dataclasses
import json
import math
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_tfm.drafting.builders import (
    DDTREE_SAMPLED_FIRST_RANK_EXPONENT,
    SAMPLED_FIRST_RANK_EXPONENT,
    build_chain,
)
from vllm_tfm.drafting.weaver import WeaverConfig
from vllm_tfm.drafting.weaver_checkpoint import load_weaver, random_weaver
from vllm_tfm.tiny import family as tiny_family
from vllm_tfm.training import (
    acceptance,
    data,
    dflash,
    eval_acceptance,
    generate_features,
    paired_trees,
    target,
    train_dflash,
    train_family,
    train_target,
    train_weaver,
    weaver_lk,
)

torch.set_num_threads(1)


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


@pytest.fixture(scope="module")
def family():
    return tiny_family.build_family()


@pytest.fixture(scope="module")
def tiny_target(family):
    return target.Target(family.target)


# -- LK loss ---------------------------------------------------------------------------


def _hand_lk(p: list[float], logq: list[float], eta: float, greedy: float) -> float:
    q = [math.exp(v) for v in logq]
    alpha = sum(min(a, b) for a, b in zip(p, q))
    lam = math.exp(-eta * alpha)
    kl = sum(a * (math.log(a) - lq) for a, lq in zip(p, logq) if a > 0)
    best = max(range(len(p)), key=lambda i: (p[i], -i))
    return lam * kl + (1 - lam) * (1 - alpha) - greedy * logq[best]


@pytest.mark.parametrize("shape", [(1, 1), (3, 2), (5, 7), (2, 64)])
def test_lk_loss_matches_float64_hand_computation(shape):
    gen = torch.Generator().manual_seed(_seed())
    rows, pool = shape
    logits = torch.randn(rows, pool, generator=gen, dtype=torch.float64) * 3
    p = torch.softmax(logits, -1)
    if pool > 2:
        p[:, 0] = 0.0  # exact zeros: p log p must count as 0
        p = p / p.sum(-1, keepdim=True)
    logq = torch.log_softmax(torch.randn(rows, pool, generator=gen, dtype=torch.float64), -1)
    logq.requires_grad_(True)
    terms = weaver_lk.lk_loss(p, logq, eta=2.0, greedy_weight=0.1)
    hand = [_hand_lk(p[r].tolist(), logq[r].tolist(), 2.0, 0.1) for r in range(rows)]
    expected = sum(hand) / rows
    assert math.isfinite(terms.loss.item())
    assert abs(terms.loss.item() - expected) <= 1e-12 * max(1.0, abs(expected))
    q = logq.detach().exp()
    assert torch.allclose(terms.alpha, torch.minimum(p, q).sum(-1), rtol=0, atol=1e-14)

    # lambda is a stop-gradient: the gradient is that of the loss with lambda frozen.
    terms.loss.backward()
    frozen = logq.detach().clone().requires_grad_(True)
    lam = torch.exp(-2.0 * torch.minimum(p, q).sum(-1))
    qf = frozen.exp()
    alpha = torch.minimum(p, qf).sum(-1)
    kl = (torch.xlogy(p, p) - torch.where(p > 0, p * frozen, 0.0)).sum(-1)
    ce = -frozen.gather(-1, p.argmax(-1, keepdim=True))[..., 0]
    ((lam * kl + (1 - lam) * (1 - alpha) + 0.1 * ce).mean()).backward()
    error = (logq.grad - frozen.grad).norm() / frozen.grad.norm().clamp(min=1e-30)
    assert error <= 1e-12


def test_pool_target_renormalises_and_reports_mass():
    gen = torch.Generator().manual_seed(_seed())
    for vocab, pool in ((7, 1), (7, 7), (50, 12)):
        logits = torch.randn(4, vocab, generator=gen) * 4
        ids = torch.stack([torch.randperm(vocab, generator=gen)[:pool] for _ in range(4)])
        p, retained = weaver_lk.pool_target(logits, ids)
        full = torch.softmax(logits.double(), -1)
        assert torch.allclose(retained.double(), full.gather(-1, ids).sum(-1), atol=1e-6)
        assert torch.allclose(p.sum(-1), torch.ones(4), atol=1e-6)
        assert torch.isfinite(p).all()


# -- Weaver teacher forcing ---------------------------------------------------------------


@pytest.mark.parametrize("layout", ["rope_swiglu", "learned_pos"])
@pytest.mark.parametrize("depth,pool", [(1, 1), (3, 5), (6, 16)])
def test_teacher_forcing_matches_weaver_rounds(layout, depth, pool):
    """Teacher-forced log q of a path == the inference path's expand, node by node."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    vocab, d_model, rows = 40, 24, 3
    config = WeaverConfig(d_model=d_model, d_embed=d_model, d_rank=16, num_layers=2,
                          num_heads=2, mlp_dim=20, K=max(depth, 2), candidate_pool_size=pool,
                          layout=layout)
    weaver = random_weaver(config, seed=seed).double()
    embed = torch.randn(vocab, d_model, generator=gen, dtype=torch.float64)
    lm_head = torch.randn(vocab, d_model, generator=gen, dtype=torch.float64) / 5
    h_v = torch.randn(rows, d_model, generator=gen, dtype=torch.float64)
    hidden = torch.randn(rows, depth, d_model, generator=gen, dtype=torch.float64)
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:pool]
                       for _ in range(rows * depth)]).view(rows, depth, pool)
    scores = torch.randn(rows, depth, pool, generator=gen, dtype=torch.float64)
    nodes = torch.randint(0, vocab, (rows, depth), generator=gen)
    forced = weaver_lk.teacher_forced_logq(weaver, h_v, hidden, nodes, ids, scores, embed,
                                           lm_head)
    weaver.prepare_tables(embed, lm_head)
    session = weaver.start_round(h_v, hidden, ids, scores, max_nodes=depth)
    expected = torch.full((rows, depth, pool), float("nan"), dtype=torch.float32)
    for j in range(depth):
        column = torch.full((rows, 1), j, dtype=torch.int64)
        expected[:, j] = session.expand(column, nodes[:, j : j + 1], column - 1, column)[:, 0]
    assert torch.isfinite(forced).all() and torch.isfinite(expected).all()
    error = (forced.double() - expected.double()).norm() / expected.double().norm().clamp(min=1)
    assert error <= 1e-5, f"seed {seed}: relative error {error:.2e}"


# -- DFlash drafter -----------------------------------------------------------------------


def _tiny_drafter(seed: int, layers: int = 2) -> dflash.DFlashDrafter:
    config = dict(tiny_family.DFLASH_CONFIG, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=layers, head_dim=8, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64)
    config["dflash_config"] = {"mask_token_id": 3, "target_layer_ids": [0, 1]}
    torch.manual_seed(seed)
    drafter = dflash.DFlashDrafter(config, target_hidden_size=16)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return drafter


@pytest.mark.parametrize("blocks,width", [(1, 1), (1, 16), (3, 5), (4, 16)])
def test_dflash_blocks_see_only_their_context_and_block(blocks, width):
    """Many blocks in one pass == each block alone with its context cut at its anchor;
    inside a block attention is non-causal."""
    seed = _seed()
    drafter = _tiny_drafter(seed).double()
    gen = torch.Generator().manual_seed(seed)
    batch, length = 2, 24
    aux = torch.randn(batch, length, 32, generator=gen, dtype=torch.float64)
    embed = torch.randn(64, 32, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, 64, (batch, blocks, width), generator=gen)
    anchors = torch.randint(1, length + 1, (batch, blocks), generator=gen)
    together = drafter(aux, tokens, anchors, embed)
    assert together.shape == (batch, blocks, width, 32) and torch.isfinite(together).all()
    for b in range(batch):
        for a in range(blocks):
            p = int(anchors[b, a])
            alone = drafter(aux[b : b + 1, :p], tokens[b : b + 1, a : a + 1],
                            anchors[b : b + 1, a : a + 1], embed)
            error = (together[b, a] - alone[0, 0]).norm() / alone.norm()
            assert error <= 1e-12, f"seed {seed}: block ({b}, {a}) error {error:.2e}"
    if width > 1:
        changed = tokens.clone()
        changed[:, :, -1] = (changed[:, :, -1] + 1) % 64
        moved = drafter(aux, changed, anchors, embed)
        assert not torch.allclose(moved[:, :, 0], together[:, :, 0])


def test_dflash_checkpoint_names_round_trip(family, tmp_path):
    drafter = dflash.DFlashDrafter.load(family.dflash, tiny_family.HIDDEN)
    assert set(drafter.state_dict()) == set(tiny_family.dflash_state_dict())
    drafter.save(tmp_path / "copy")
    again = dflash.DFlashDrafter.load(tmp_path / "copy", tiny_family.HIDDEN)
    for key, value in drafter.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
    saved = json.loads((tmp_path / "copy" / "config.json").read_text())
    assert saved == json.loads((family.dflash / "config.json").read_text())
    state = load_file(str(tmp_path / "copy" / "model.safetensors"))
    state["extra.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "copy" / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected keys"):
        dflash.DFlashDrafter.load(tmp_path / "copy", tiny_family.HIDDEN)


# -- target scoring -------------------------------------------------------------------------


def test_target_scoring_matches_full_forward(tiny_target):
    gen = torch.Generator().manual_seed(_seed())
    ids = torch.randint(4, tiny_target.vocab_size, (1, 30), generator=gen)
    layer_ids = tiny_family.DFLASH_TARGET_LAYER_IDS
    full = tiny_target.forward(ids, layer_ids)
    session = tiny_target.session(layer_ids)
    session.extend(ids[:, :20])
    paths = torch.stack([ids[0, 20:26], torch.cat([ids[0, 20:23], ids[0, 3:6]])])
    scored = session.score_paths(paths)
    scale = full.logits.norm()
    assert (scored.logits[0] - full.logits[0, 20:26]).norm() / scale <= 1e-5
    assert (scored.logits[1, :3] - full.logits[0, 20:23]).norm() / scale <= 1e-5
    out = session.extend(ids[:, 20:30])  # scoring left the session untouched
    assert (out.logits - full.logits[:, 20:]).norm() / scale <= 1e-5
    assert (out.aux - full.aux[:, 20:]).norm() / full.aux.norm() <= 1e-5
    with pytest.raises(ValueError, match="target_layer_ids"):
        tiny_target.forward(ids, (tiny_target.num_layers - 1,))


def test_source_splits_are_disjoint_and_windows_deterministic(family):
    train, held = data.stdlib_sources("train"), data.stdlib_sources("heldout")
    assert not set(train) & set(held) and len(held) == len(data.HELDOUT_MODULES)
    tokenizer = data.load_tokenizer(family.target)
    windows = data.SourceWindows(tokenizer, held)
    first = windows.sample(3, 17, torch.Generator().manual_seed(5))
    again = windows.sample(3, 17, torch.Generator().manual_seed(5))
    assert first.shape == (3, 17) and torch.equal(first, again)
    with pytest.raises(ValueError, match="split"):
        data.stdlib_sources("valid")


# -- overfitting a tiny batch ---------------------------------------------------------------


def test_dflash_and_weaver_losses_fall_on_a_tiny_batch():
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    drafter = _tiny_drafter(seed, layers=1)
    vocab, length = 64, 40
    embed = torch.randn(vocab, 32, generator=gen)
    lm_head = torch.randn(vocab, 32, generator=gen) / 4
    tokens = torch.randint(4, vocab, (2, length), generator=gen)
    aux = torch.randn(2, length, 32, generator=gen)
    anchors = torch.randint(1, length - drafter.block_size + 1, (2, 3), generator=gen)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(120):
        loss, _ = dflash.block_loss(drafter, aux, tokens, anchors, embed, lm_head)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0], f"seed {seed}: {losses[0]:.3f} -> {losses[-1]:.3f}"

    config = WeaverConfig(d_model=32, d_embed=32, d_rank=16, num_layers=1, num_heads=2,
                          mlp_dim=32, K=15, candidate_pool_size=16)
    weaver = random_weaver(config, seed=seed).train()
    with torch.no_grad():
        hidden = drafter(aux, drafter.block_inputs(tokens.gather(1, anchors)), anchors, embed)
    hidden = hidden[:, :, 1:].flatten(0, 1)
    ids, scores = weaver_lk.lm_head_pools(hidden, lm_head, 16)
    p, _ = weaver_lk.pool_target(torch.randn(6, 15, vocab, generator=gen) * 3, ids)
    nodes = torch.randint(4, vocab, (6, 15), generator=gen)
    h_v = torch.randn(6, 32, generator=gen)
    optimizer = torch.optim.AdamW(weaver.parameters(), lr=3e-3)
    lk = []
    for _ in range(40):
        logq = weaver_lk.teacher_forced_logq(weaver, h_v, hidden, nodes, ids, scores, embed,
                                             lm_head)
        loss = weaver_lk.lk_loss(p, logq).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        lk.append(loss.item())
    assert all(math.isfinite(v) for v in lk)
    assert lk[-1] < 0.7 * lk[0], f"seed {seed}: {lk[0]:.3f} -> {lk[-1]:.3f}"


# -- the tools end to end -------------------------------------------------------------------

@pytest.fixture(scope="module")
def features_dir(family, tmp_path_factory):
    """Features of 6 training and 3 held-out continuations of the random tiny target."""
    out = tmp_path_factory.mktemp("features") / "features"
    generate_features.main(["--out", str(out), "--num-seqs", "6", "--heldout-seqs", "3",
                            "--prompt-len", "8", "--new-tokens", "24", "--shard-seqs", "4",
                            "--device", "cpu"])
    return out


@pytest.fixture(scope="module")
def trained(family, features_dir, tmp_path_factory):
    """train_dflash: 4 steps in one run, and 2 + 2 steps in a resumed run."""
    root = tmp_path_factory.mktemp("tools")
    common = ["--features", str(features_dir), "--batch", "2", "--anchors", "2",
              "--eval-every", "0", "--save-every", "2", "--device", "cpu"]
    whole = train_dflash.main(["--out", str(root / "whole"), "--steps", "4", *common])
    first = train_dflash.main(["--out", str(root / "split"), "--steps", "2", *common])
    resumed = train_dflash.main(["--out", str(root / "split"), "--steps", "4", *common])
    return {"root": root, "whole": whole, "first": first, "resumed": resumed}


def test_train_dflash_writes_a_loadable_drafter_and_resumes(family, trained):
    root = trained["root"]
    whole = dflash.DFlashDrafter.load(root / "whole", tiny_family.HIDDEN)
    split = dflash.DFlashDrafter.load(root / "split", tiny_family.HIDDEN)
    start = dflash.DFlashDrafter.load(family.dflash, tiny_family.HIDDEN)
    assert set(whole.state_dict()) == set(tiny_family.dflash_state_dict())
    assert (root / "whole.ckpt").is_file() and not (root / "whole" / "whole.ckpt").exists()
    assert [h["step"] for h in trained["whole"]["history"]] == [0, 4]
    # The resumed run did not start over: it continues the saved history (no second
    # step-0 evaluation) and the loss curve, and it ends where the
    # uninterrupted run ends, weight for weight.
    assert [h["step"] for h in trained["resumed"]["history"]] == [0, 2, 4]
    assert trained["resumed"]["step"] == 4
    curves = json.loads((root / "split.training.json").read_text())
    assert [step for step, _ in curves["losses"]] == [1, 2, 3, 4]
    assert (root / "split.training.png").is_file()
    for key, value in whole.state_dict().items():
        assert torch.equal(value, split.state_dict()[key]), key
    assert any(not torch.equal(v, start.state_dict()[k]) for k, v in whole.state_dict().items())
    assert all(math.isfinite(h["heldout_loss"]) for h in trained["whole"]["history"])


def test_train_weaver_writes_both_formats(family, features_dir, trained):
    root = trained["root"]
    summary = train_weaver.main([
        "--dflash", str(root / "whole"), "--out", str(root / "weaver"),
        "--features", str(features_dir), "--steps", "2", "--batch", "2", "--anchors", "2",
        "--eval-every", "0", "--eval-budget", "8", "--device", "cpu",
    ])
    directory = load_weaver(root / "weaver", target_hidden_size=tiny_family.HIDDEN)
    public = load_weaver(root / "weaver.pth", target_hidden_size=tiny_family.HIDDEN)
    for key, value in directory.state_dict().items():
        assert torch.equal(value, public.state_dict()[key]), key
    assert directory.config.candidate_pool_size == min(512, tiny_family.VOCAB_SIZE)
    mass = summary["heldout_pool_retained_mass"]
    assert 0.0 <= mass["p05"] <= 1.0 + 1e-6 and 0.0 <= mass["mean"] <= 1.0 + 1e-6
    assert [h["step"] for h in summary["history"]] == [0, 2]


def test_train_target_smoke_run_writes_a_loadable_model(family, tmp_path):
    out = tmp_path / "target"
    summary = train_target.main(["--out", str(out), "--steps", "2", "--batch", "2",
                                 "--seq-len", "16", "--eval-batches", "1", "--device", "cpu"])
    assert math.isfinite(summary["train_loss"]) and summary["step"] == 2
    assert (out / "tokenizer.json").is_file()
    model = target.Target(out)
    logits = model.forward(torch.tensor([[5, 6, 7]])).logits
    assert torch.isfinite(logits).all()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_train_family_smoke_run_writes_a_family_that_loads(family, tmp_path):
    out = tmp_path / "family"
    manifest = train_family.main(["--out", str(out), "--work", str(tmp_path / "work"),
                                  "--base", str(family.root), "--smoke", "--device", "cpu"])
    assert set(manifest["recipe"]) == {"target", "features", "dflash", "weaver"}
    assert set(manifest["results"]) == {"target", "features", "dflash", "weaver"}
    assert manifest["data"]["heldout_modules"] == list(data.HELDOUT_MODULES)
    loaded = tiny_family.trained_family(out)
    assert (loaded.target / "model.safetensors").is_file()
    target.Target(loaded.target)
    dflash.DFlashDrafter.load(loaded.dflash, tiny_family.HIDDEN)
    load_weaver(loaded.weaver, target_hidden_size=tiny_family.HIDDEN)

    # A changed or missing file is named.
    weights = out / "dflash" / "model.safetensors"
    changed = bytearray(weights.read_bytes())
    changed[-1] ^= 0xFF
    weights.write_bytes(bytes(changed))
    with pytest.raises(ValueError, match="dflash/model.safetensors is altered"):
        tiny_family.trained_family(out)
    weights.unlink()
    with pytest.raises(ValueError, match="dflash/model.safetensors is missing"):
        tiny_family.trained_family(out)


def test_committed_trained_family_matches_its_manifest():
    loaded = tiny_family.trained_family()
    config = json.loads((loaded.target / "config.json").read_text())
    assert config["model_type"] == "qwen3_next"
    assert json.loads((loaded.dflash / "config.json").read_text())["architectures"] == [
        "DFlashDraftModel"]


# -- eval: tau against a hand count ---------------------------------------------------------


@dataclasses.dataclass
class OracleDrafters(acceptance.Drafters):
    """Chains whose first k(p) tokens are the target's greedy continuation and whose
    next token is wrong: greedy decoding must accept exactly min(k(p), D) per step."""

    truth: torch.Tensor | None = None
    rule: Callable[[int], int] | None = None

    def propose(self, method, budget, roots, aux, anchors, h_v, sample_seeds=None):
        depth = self.depth(method, budget)
        vocab = self.target.vocab_size
        rows = []
        for p in anchors.tolist():
            want = self.truth[p + 1 : p + 1 + depth]
            wrong = torch.arange(depth) >= self.rule(p)
            rows.append(torch.where(wrong, (want + 1) % vocab, want))
        first = torch.stack(rows)[..., None]
        ids = torch.cat([first, (first + torch.arange(1, 4)) % vocab], -1)
        logits = -torch.arange(4.0).expand(ids.shape).contiguous()
        return build_chain(roots, ids, logits, budget), ids


def _hand_tau(rule, start: int, depth: int, stop) -> float:
    p, produced, steps = start, 0, 0
    while not stop(p, produced):
        accepted = min(rule(p), depth)
        produced += accepted + 1
        steps += 1
        p += accepted + 1
    return produced / steps


def test_eval_tau_on_a_chain_equals_a_hand_count(family, tiny_target, trained, tmp_path):
    drafter = dflash.DFlashDrafter.load(family.dflash, tiny_target.hidden_size)
    base = acceptance.Drafters(tiny_target, drafter)
    prompt = torch.tensor(data.load_tokenizer(family.target).encode("def main(argv):\n").ids)
    extra, new_tokens = 60, 30
    session = tiny_target.session()
    logits = session.extend(prompt[None]).logits[0, -1]
    truth = prompt.tolist()
    for _ in range(new_tokens + extra):
        truth.append(int(logits.argmax()))
        logits = session.extend(torch.tensor([[truth[-1]]])).logits[0, -1]
    truth = torch.tensor(truth)
    rule = lambda p: (p * 7) % 5 + (p % 3 == 0) * 12  # noqa: E731  (some >= D)
    oracle = OracleDrafters(base.target, base.dflash, truth=truth, rule=rule)
    depth, start = drafter.draft_depth, prompt.numel()

    stats = acceptance.simulate(oracle, "chain", depth, prompt, 0.0, new_tokens, seed=0)
    assert stats.tokens == truth[start : start + len(stats.tokens)].tolist()
    expected = _hand_tau(rule, start, depth, lambda p, produced: produced >= new_tokens)
    assert stats.produced / stats.steps == pytest.approx(expected, rel=1e-12)
    assert all(0.0 <= m <= 1.0 + 1e-6 for step in stats.retained for m in step)

    layer_ids = drafter.target_layer_ids
    out = tiny_target.forward(truth[None], layer_ids)
    tau = acceptance.greedy_tau(oracle, "chain", depth, truth[None], out.aux, out.final, start)
    length = truth.numel()
    expected = _hand_tau(rule, start, depth, lambda p, produced: p + depth + 1 >= length)
    assert tau == pytest.approx(expected, rel=1e-12)

    # The tool's own numbers on a real (barely trained) drafter, all three trees.
    report = eval_acceptance.main([
        "--family", "random", "--dflash", str(trained["root"] / "whole"),
        "--out", str(tmp_path / "eval.json"), "--num-prompts", "1", "--prompt-len", "8",
        "--max-new-tokens", "6", "--budgets", "8", "--temperatures", "0", "1",
        "--device", "cpu",
    ])
    assert (tmp_path / "eval.png").is_file()
    rows = {(r["temperature"], r["method"], r["budget"], r["trees"], r["verifier"])
            for r in report["results"]}
    deterministic = {(0.0, "chain", depth, "deterministic", "greedy"),
                     (0.0, "ddtree", 8, "deterministic", "greedy"),
                     (0.0, "weaver", 8, "deterministic", "greedy"),
                     (1.0, "chain", depth, "deterministic", "target-only"),
                     (1.0, "ddtree", 8, "deterministic", "target-only"),
                     (1.0, "weaver", 8, "deterministic", "target-only")}
    assert rows == deterministic | {(1.0, "ddtree", 8, "sampled", "traversal"),
                                    (1.0, "weaver", 8, "sampled", "traversal")}
    assert all(r["tau"] >= 1.0 and r["steps"] >= 1 for r in report["results"])
    summary = report["summary"]
    assert set(summary) == {"T=0", "T=1"}
    assert "weaver8 auto" not in summary["T=0"]
    # At T = 1 "auto" gives both kinds sampled trees (options.AUTO_SAMPLED_TREE_MIN_TEMPERATURE).
    for method in ("ddtree8", "weaver8"):
        assert summary["T=1"][f"{method} auto"] == summary["T=1"][f"{method} sampled"]
    assert summary["T=1"]["weaver8/chain"] == pytest.approx(
        summary["T=1"]["weaver8 sampled"] / summary["T=1"]["chain"])

    # Paired contexts: every position of the greedy continuation, each a hand count.
    positions = 40
    table = paired_trees.prompt_contexts(oracle, [paired_trees.TreeSpec("chain", depth)], prompt,
                                         0.0, positions, tree_samples=1, seed=0)
    assert table[0].tolist() == [min(rule(start + i), depth) for i in range(positions)]

    with pytest.raises(ValueError, match="--tree-draws sampled: sampled trees exist only"):
        eval_acceptance.main([
            "--family", "random", "--dflash", str(trained["root"] / "whole"),
            "--out", str(tmp_path / "none.json"), "--temperatures", "0",
            "--tree-draws", "sampled", "--device", "cpu"])


def test_eval_acceptance_drafts_at_the_expand_width_and_first_exponent_asked(trained, tmp_path,
                                                                            monkeypatch):
    calls = []
    real = acceptance.draft_trees

    def recording(*args, **kwargs):
        calls.append((kwargs["expand_width"], kwargs["first_exponent"],
                      kwargs["sample_seeds"] is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(acceptance, "draft_trees", recording)
    args = ["--family", "random", "--dflash", str(trained["root"] / "whole"),
            "--out", str(tmp_path / "eval.json"), "--num-prompts", "1", "--prompt-len", "8",
            "--max-new-tokens", "4", "--budgets", "8", "--methods", "weaver", "--device", "cpu"]
    eval_acceptance.main([*args, "--temperatures", "0", "--expand-width", "3"])
    assert calls and set(calls) == {(3, None, False)}  # each kind's own exponent
    calls.clear()
    eval_acceptance.main([*args, "--temperatures", "1", "--tree-draws", "sampled",
                          "--first-exponent", "0.25"])
    assert calls and set(calls) == {(None, 0.25, True)}
    with pytest.raises(ValueError, match=r"--expand-width must be in \[1, 32\], got 0"):
        eval_acceptance.main([*args, "--expand-width", "0"])
    with pytest.raises(ValueError, match=r"--first-exponent must be in \(0, 1\], got 1.5"):
        eval_acceptance.main([*args, "--first-exponent", "1.5"])


def test_compare_trees_pairs_specs_on_the_same_contexts(trained, tmp_path):
    args = ["--family", "random", "--dflash", str(trained["root"] / "whole"),
            "--num-prompts", "2", "--prompt-len", "8", "--positions", "3", "--device", "cpu"]
    specs = ["ddtree:8:sampled", "weaver:8:sampled", "weaver:8:sampled:1", "weaver:8", "chain:4"]
    rows = paired_trees.main([*args, "--out", str(tmp_path / "a.json"), "--specs", *specs])
    assert [row["spec"] for row in rows] == [
        f"ddtree:8:sampled:{DDTREE_SAMPLED_FIRST_RANK_EXPONENT:g}",
        f"weaver:8:sampled:{SAMPLED_FIRST_RANK_EXPONENT:g}",
        "weaver:8:sampled:1", "weaver:8", "chain:4"]
    assert rows[0]["ratio_to_first"] == 1 and rows[0]["difference_to_first"] == 0
    report = json.loads((tmp_path / "a.json").read_text())
    tables = torch.tensor(report["expected_accepted"])  # [prompts, specs, positions]
    assert tables.shape == (2, 5, 3) and torch.isfinite(tables).all()
    depths = torch.tensor([8, 8, 8, 8, 4], dtype=torch.float64)[None, :, None]
    assert ((tables >= 0) & (tables <= depths)).all()
    for index, row in enumerate(rows):
        assert row["tau_per_position"] == pytest.approx(1 + tables[:, index].mean().item())
    # Same seeds, same contexts, same trees: a rerun of a subset repeats its rows.
    again = paired_trees.main([*args, "--out", str(tmp_path / "b.json"), "--specs", specs[2],
                               specs[0]])
    assert again[0]["tau_per_position"] == rows[2]["tau_per_position"]
    assert again[1]["tau_per_position"] == rows[0]["tau_per_position"]

    explicit = paired_trees.TreeSpec.parse("ddtree:8:sampled:0.5")
    assert (explicit.first_exponent, explicit.label) == (0.5, "ddtree:8:sampled:0.5")
    for bad, message in [("weaver:8:sampled:1.5", "FIRST_EXPONENT"),
                         ("chain:4:sampled", "the third field"), ("tree:8", "KIND in"),
                         ("weaver:x", "BUDGET must be an int")]:
        with pytest.raises(ValueError, match=message):
            paired_trees.main([*args, "--out", str(tmp_path / "c.json"), "--specs", bad])
    with pytest.raises(ValueError, match="above 0 for sampled specs"):
        paired_trees.main([*args, "--out", str(tmp_path / "c.json"), "--specs", specs[0],
                           "--temperature", "0"])
