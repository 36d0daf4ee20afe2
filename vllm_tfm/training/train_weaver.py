"""Train a Weaver from stored target features and a frozen DFlash drafter with the LK loss
(DESIGN.md section 3).

    python tools/train_weaver.py --features work/features --dflash work/dflash \
        --out work/weaver [--steps 1500] [--batch 16] [--accumulate 1] [--init PTH|DIR]
    torchrun --nproc_per_node 8 tools/train_weaver.py ...      (8 processes, same result)

Teacher forcing over the ground-truth path of target-generated sequences: for a block
at anchor p the DFlash states H_1..H_15 and the target's final state before p build the
prefix, the nodes are x_p..x_{p+14}, and node j's q over pool row j is compared with
the target's next-token distribution at x_{p+j} restricted to the pool (P = min(512, V))
and renormalised (vllm_tfm/training/weaver_lk.py); the target's logits come from the
stored final states and the LM head (vllm_tfm/training/features.py says why that is
exact). Loss: lambda KL(p||q) + (1 - lambda)(1 - alpha) + 0.1 CE(argmax p), alpha =
sum min(p, q), lambda = exp(-2 stopgrad(alpha)). AdamW, warm-up + cosine; bf16 autocast
on CUDA.

Without --init the Weaver starts random (`random_weaver`, shapes from --d-rank /
--num-heads / --mlp-dim / --layout, d_model and d_embed from the target) with
lm_head_query_in zeroed, so q starts as the DFlash marginal over the pool. Every
--eval-every steps: held-out greedy tau of TfM(B) (B = --eval-budget; exact on greedy
continuations; chain and DDTree(B) once, for comparison), held-out alpha of the marginal
and of Weaver, and the pool's retained target mass (mean and 5% tail). Writes `<out>/`
(config.json + model.safetensors) and the public `<out>.pth`; resumable state in
`<out>.ckpt`; curves in `<out>.training.{json,png}`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from vllm_tfm.drafting.weaver import LAYOUTS, WeaverConfig
from vllm_tfm.drafting.weaver_checkpoint import (
    load_weaver,
    random_weaver,
    save_weaver_public,
    save_weaver_safetensors,
)
from vllm_tfm.options import DEFAULT_BASELINE_POOL
from vllm_tfm.training.acceptance import Drafters, greedy_tau
from vllm_tfm.training.dflash import DFlashDrafter, sample_anchors
from vllm_tfm.training.features import FeatureBatch, FeatureSplit, StoredFeatures, TargetHead
from vllm_tfm.training.loop import (
    Job,
    add_run_args,
    fill_family_defaults,
    report,
    setup_runtime,
    step_generator,
    train,
)
from vllm_tfm.training.weaver_lk import (
    lk_loss,
    lm_head_pools,
    pool_target,
    teacher_forced_logq,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="Weaver directory to write")
    parser.add_argument("--public-out", help="public .pth to write (default: <out>.pth)")
    parser.add_argument("--features", required=True,
                        help="feature directory (tools/generate_features.py)")
    parser.add_argument("--dflash", help="trained DFlash drafter directory (default: tiny family)")
    parser.add_argument("--init", help="Weaver .pth or directory to start from (default: random)")
    parser.add_argument("--d-rank", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--mlp-dim", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--layout", default="rope_swiglu", choices=LAYOUTS)
    parser.add_argument("--pool-size", type=int, default=DEFAULT_BASELINE_POOL)
    parser.add_argument("--anchors", type=int, default=4, help="blocks per sequence")
    parser.add_argument("--eval-budget", type=int, default=64)
    add_run_args(parser, steps=1500, lr=1e-3, weight_decay=0.01, warmup=50, save_every=250,
                 batch=16)
    return parser.parse_args(argv)


def initial_weaver(args, head: TargetHead, drafter: DFlashDrafter):
    if args.init:
        return load_weaver(args.init, target_hidden_size=head.hidden_size,
                           target_vocab_size=head.vocab_size)
    config = WeaverConfig(
        d_model=head.hidden_size, d_embed=head.embed.shape[1], d_rank=args.d_rank,
        num_layers=args.num_layers, num_heads=args.num_heads, mlp_dim=args.mlp_dim,
        K=drafter.draft_depth, candidate_pool_size=min(args.pool_size, head.vocab_size),
        layout=args.layout,
    )
    weaver = random_weaver(config, seed=args.seed)
    with torch.no_grad():
        weaver.lm_head_query_in.weight.zero_()
    return weaver


@torch.no_grad()
def teacher_inputs(drafter: DFlashDrafter, head: TargetHead, rows: FeatureBatch,
                   anchors: torch.Tensor, pool_size: int) -> dict[str, torch.Tensor]:
    """Frozen inputs and targets of Weaver training for blocks at `anchors` [B, A] of
    `rows`, flattened to M = B x A blocks: h_v, H, node tokens, pools, target p and the
    target mass the pool retains."""
    device = head.device
    depth = drafter.draft_depth
    tokens, final = rows.tokens.to(device), rows.final.to(device)
    anchors = anchors.to(device)
    batch = torch.arange(tokens.shape[0], device=device)[:, None, None]
    span = anchors[..., None] + torch.arange(depth, device=device)  # depths 0..D-1
    blocks = drafter.block_inputs(tokens.gather(1, anchors))
    hidden = drafter(rows.aux.to(device), blocks, anchors, head.embed)[:, :, 1:]
    ids, scores = lm_head_pools(hidden, head.lm_head, pool_size)
    p, retained = pool_target(head.logits(final[batch, span]), ids)
    flat = lambda t: t.flatten(0, 1)  # noqa: E731
    return {
        "h_v": flat(final[batch[..., 0], anchors - 1].float()),
        "hidden": flat(hidden),
        "nodes": flat(tokens[batch, span]),
        "ids": flat(ids),
        "scores": flat(scores),
        "p": flat(p),
        "retained": flat(retained),
    }


def forced_logq(weaver, head: TargetHead, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return teacher_forced_logq(weaver, inputs["h_v"], inputs["hidden"], inputs["nodes"],
                               inputs["ids"], inputs["scores"], head.embed, head.lm_head)


class LKObjective(nn.Module):
    """The LK loss of a batch part {"rows", "anchors"} of the training split."""

    def __init__(self, weaver, drafter: DFlashDrafter, split: FeatureSplit, head: TargetHead,
                 pool_size: int):
        super().__init__()
        self.weaver = weaver
        # Frozen, and not submodules: DDP neither syncs nor broadcasts them.
        self.frozen = (drafter, split, head, pool_size)

    def forward(self, part: dict[str, torch.Tensor]):
        drafter, split, head, pool_size = self.frozen
        inputs = teacher_inputs(drafter, head, split.rows(part["rows"]), part["anchors"],
                                pool_size)
        terms = lk_loss(inputs["p"], forced_logq(self.weaver, head, inputs))
        return terms.loss, {"alpha": terms.alpha.mean()}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    fill_family_defaults(args, dflash="dflash")
    out = Path(args.out)
    public_out = Path(args.public_out) if args.public_out else out.with_name(out.name + ".pth")
    runtime = setup_runtime(args.device, args.threads)
    device = runtime.device
    stored = StoredFeatures.load(args.features, device)
    head, held = stored.head, stored.heldout
    drafter = DFlashDrafter.load(args.dflash, head.hidden_size).to(device).eval()
    drafter.requires_grad_(False)
    block = drafter.block_size
    stored.check_drafter(drafter.target_layer_ids, block)
    weaver = initial_weaver(args, head, drafter).to(device).train()
    if weaver.config.K < drafter.draft_depth:
        raise ValueError(f"Weaver K={weaver.config.K} < DFlash depth {drafter.draft_depth}")
    anchor_range = (stored.prompt_len, stored.seq_len - block)
    held_anchors = sample_anchors(held.tokens.shape[0], args.anchors, *anchor_range,
                                  step_generator(args.seed, -1))
    held_inputs = teacher_inputs(drafter, head, held, held_anchors, args.pool_size)
    retained = held_inputs["retained"].float().flatten()
    pool_mass = {"mean": retained.mean().item(), "p05": retained.quantile(0.05).item()}
    drafters = Drafters(head, drafter, weaver, pool_size=args.pool_size)
    held_args = (held.tokens, held.aux, held.final, stored.prompt_len)
    baselines = {
        "chain": greedy_tau(drafters, "chain", drafter.draft_depth, *held_args),
        f"ddtree{args.eval_budget}": greedy_tau(drafters, "ddtree", args.eval_budget,
                                                 *held_args),
    }
    marginal = lk_loss(held_inputs["p"], torch.log_softmax(held_inputs["scores"].float(), -1))
    if runtime.is_main:
        tqdm.write(json.dumps({"heldout_pool_retained_mass": pool_mass,
                               "heldout_greedy_tau": baselines,
                               "heldout_alpha_marginal": marginal.alpha.mean().item()}))

    def sample(step: int) -> dict[str, torch.Tensor]:
        generator = step_generator(args.seed, step)
        rows = torch.randint(0, stored.train.num_sequences, (args.batch,), generator=generator)
        return {"rows": rows,
                "anchors": sample_anchors(args.batch, args.anchors, *anchor_range, generator)}

    def evaluate(step: int) -> dict:
        weaver.eval()
        with torch.no_grad():
            terms = lk_loss(held_inputs["p"], forced_logq(weaver, head, held_inputs))
            weaver.prepare_tables(head.embed, head.lm_head)
            tau = greedy_tau(drafters, "weaver", args.eval_budget, *held_args)
        weaver.train()
        return {"step": step, "heldout_lk_loss": terms.loss.item(),
                "heldout_alpha": terms.alpha.mean().item(),
                f"heldout_greedy_tau_weaver{args.eval_budget}": tau}

    def export(step: int) -> None:
        metadata = {"features": str(args.features), "drafter": str(args.dflash), "steps": step,
                    "pool_retained_mass": pool_mass}
        save_weaver_safetensors(weaver, out, metadata=metadata)
        save_weaver_public(weaver, public_out, metadata=metadata)

    objective = LKObjective(weaver, drafter, stored.train, head, args.pool_size)
    job = Job(name="weaver", model=weaver, objective=objective, sample=sample,
              evaluate=evaluate, export=export)
    return report(runtime, train(args, runtime, job, out).summary(
        out=str(out), public_out=str(public_out), heldout_pool_retained_mass=pool_mass,
        heldout_greedy_tau=baselines))


if __name__ == "__main__":
    main()
