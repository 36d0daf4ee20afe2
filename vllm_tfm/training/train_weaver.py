"""Train a Weaver on a frozen target + frozen DFlash drafter with the LK loss (DESIGN.md section 3).

    python tools/train_weaver.py --dflash artifacts/trained_tiny/dflash \
        --out artifacts/trained_tiny/weaver [--steps 1500] [--target DIR] [--init PTH|DIR]

Teacher forcing over the ground-truth path of target-generated sequences: for a block
at anchor p the DFlash states H_1..H_15 and the target's final state before p build the
prefix, the nodes are x_p..x_{p+14}, and node j's q over pool row j is compared with
the target's next-token distribution at x_{p+j} restricted to the pool (P = min(512, V))
and renormalised (vllm_tfm/training/weaver_lk.py). Loss: lambda KL(p||q) +
(1 - lambda)(1 - alpha) + 0.1 CE(argmax p), alpha = sum min(p, q), lambda =
exp(-2 stopgrad(alpha)). AdamW, warm-up + cosine.

Without --init the Weaver starts random (`random_weaver`, shapes from --d-rank /
--num-heads / --mlp-dim / --layout, d_model and d_embed from the target) with
lm_head_query_in zeroed, so q starts as the DFlash marginal over the pool. Every
--eval-every steps: held-out greedy tau of chain, DDTree(B) and TfM(B) (B =
--eval-budget; exact on greedy continuations), held-out alpha of the marginal and of
Weaver, and the pool's retained target mass (mean and 5% tail). Writes
`<out>/` (config.json + model.safetensors) and the public `<out>.pth`; resumable state
in `<out>.ckpt`. The continuation cache (`--data`) is shared with train_dflash.py when
both use the same data arguments.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_tfm.drafting.weaver import LAYOUTS, WeaverConfig
from vllm_tfm.drafting.weaver_checkpoint import (
    load_weaver,
    random_weaver,
    save_weaver_public,
    save_weaver_safetensors,
)
from vllm_tfm.options import DEFAULT_BASELINE_POOL
from vllm_tfm.training import data
from vllm_tfm.training.acceptance import Drafters, greedy_tau
from vllm_tfm.training.dflash import DFlashDrafter, sample_anchors
from vllm_tfm.training.loop import (
    Checkpoint,
    add_run_args,
    default_checkpoint,
    fill_family_defaults,
    make_optimizer,
    run_training,
    setup_device,
    step_generator,
)
from vllm_tfm.training.target import Target
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
    parser.add_argument("--dflash", help="trained DFlash drafter directory (default: tiny family)")
    parser.add_argument("--target", help="target model directory (default: tiny family)")
    parser.add_argument("--init", help="Weaver .pth or directory to start from (default: random)")
    parser.add_argument("--data", help="continuation cache (default: <dflash>.data.pt)")
    parser.add_argument("--checkpoint", help="resumable state (default: <out>.ckpt)")
    data.add_continuation_args(parser)
    parser.add_argument("--d-rank", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--mlp-dim", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--layout", default="rope_swiglu", choices=LAYOUTS)
    parser.add_argument("--pool-size", type=int, default=DEFAULT_BASELINE_POOL)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--anchors", type=int, default=4, help="blocks per sequence")
    parser.add_argument("--eval-budget", type=int, default=64)
    add_run_args(parser, steps=1500, lr=1e-3, weight_decay=0.01, warmup=50, save_every=250)
    return parser.parse_args(argv)


def _initial_weaver(args, target: Target, drafter: DFlashDrafter):
    if args.init:
        return load_weaver(args.init, target_hidden_size=target.hidden_size,
                           target_vocab_size=target.vocab_size)
    config = WeaverConfig(
        d_model=target.hidden_size, d_embed=target.embed.shape[1], d_rank=args.d_rank,
        num_layers=args.num_layers, num_heads=args.num_heads, mlp_dim=args.mlp_dim,
        K=drafter.draft_depth, candidate_pool_size=min(args.pool_size, target.vocab_size),
        layout=args.layout,
    )
    weaver = random_weaver(config, seed=args.seed)
    with torch.no_grad():
        weaver.lm_head_query_in.weight.zero_()
    return weaver


class Blocks:
    """Frozen inputs and targets of Weaver training for blocks of a sequence set."""

    def __init__(self, target: Target, drafter: DFlashDrafter, tokens, aux, final, pool_size):
        self.target, self.drafter = target, drafter
        self.tokens, self.aux, self.final = tokens, aux, final
        self.pool_size = pool_size

    @torch.no_grad()
    def batch(self, rows: torch.Tensor, anchors: torch.Tensor) -> dict[str, torch.Tensor]:
        """Flattened [M = rows x anchors] inputs: h_v, H, node tokens, pools, target p."""
        device = self.target.device
        depth = self.drafter.draft_depth
        tokens = self.tokens[rows].to(device)
        final = self.final[rows].to(device)
        anchors = anchors.to(device)
        batch = torch.arange(rows.numel(), device=device)[:, None, None]
        span = anchors[..., None] + torch.arange(depth, device=device)  # depths 0..D-1
        blocks = self.drafter.block_inputs(tokens.gather(1, anchors))
        hidden = self.drafter(self.aux[rows].to(device), blocks, anchors, self.target.embed)
        hidden = hidden[:, :, 1:]
        ids, scores = lm_head_pools(hidden, self.target.lm_head, self.pool_size)
        p, retained = pool_target(self.target.logits(final[batch, span].float()), ids)
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


def _logq(weaver, target: Target, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return teacher_forced_logq(weaver, inputs["h_v"], inputs["hidden"], inputs["nodes"],
                               inputs["ids"], inputs["scores"], target.embed, target.lm_head)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    fill_family_defaults(args, target="target", dflash="dflash")
    out = Path(args.out)
    public_out = Path(args.public_out) if args.public_out else out.with_name(out.name + ".pth")
    device = setup_device(args.device, args.threads)
    target = Target(args.target, device)
    drafter = DFlashDrafter.load(args.dflash, target.hidden_size).to(device).eval()
    drafter.requires_grad_(False)
    layer_ids = target.check_layer_ids(drafter.target_layer_ids)
    weaver = _initial_weaver(args, target, drafter).to(device).train()
    if weaver.config.K < drafter.draft_depth:
        raise ValueError(f"Weaver K={weaver.config.K} < DFlash depth {drafter.draft_depth}")
    block = drafter.block_size
    if args.new_tokens < block:
        raise ValueError(f"--new-tokens must be at least the block size {block}")
    spec = data.continuation_spec(args)
    dflash_dir = Path(args.dflash)
    data_path = Path(args.data) if args.data else dflash_dir.with_name(dflash_dir.name + ".data.pt")
    sets = data.load_or_build_continuations(data_path, target, args.target, spec)
    train, heldout = sets["train"], sets["heldout"]
    train_blocks = Blocks(target, drafter, train.tokens,
                          *target.features(train.tokens, layer_ids), args.pool_size)
    held_aux, held_final = target.features(heldout.tokens, layer_ids)
    held_blocks = Blocks(target, drafter, heldout.tokens, held_aux, held_final, args.pool_size)
    length = train.tokens.shape[1]
    held_anchors = sample_anchors(heldout.num_sequences, args.anchors, args.prompt_len,
                                  length - block, step_generator(args.seed, -1))
    held_inputs = held_blocks.batch(torch.arange(heldout.num_sequences), held_anchors)
    retained = held_inputs["retained"].flatten()
    pool_mass = {"mean": retained.mean().item(), "p05": retained.quantile(0.05).item()}
    tqdm.write(json.dumps({"heldout_pool_retained_mass": pool_mass}))

    optimizer, scheduler = make_optimizer(
        weaver.parameters(), args.lr, args.weight_decay, args.warmup, args.steps
    )
    checkpoint = Checkpoint(args.checkpoint or default_checkpoint(out))
    step = checkpoint.restore({"weaver": weaver}, optimizer, scheduler)
    drafters = Drafters(target, drafter, weaver, pool_size=args.pool_size)
    held = (heldout.tokens, held_aux, held_final, args.prompt_len)
    baselines = {
        "chain": greedy_tau(drafters, "chain", drafter.draft_depth, *held),
        f"ddtree{args.eval_budget}": greedy_tau(drafters, "ddtree", args.eval_budget, *held),
    }
    marginal = lk_loss(held_inputs["p"], torch.log_softmax(held_inputs["scores"], -1))
    tqdm.write(json.dumps({"heldout_greedy_tau": baselines,
                           "heldout_alpha_marginal": marginal.alpha.mean().item()}))

    def evaluate(step: int) -> dict:
        weaver.eval()
        with torch.no_grad():
            terms = lk_loss(held_inputs["p"], _logq(weaver, target, held_inputs))
            weaver.prepare_tables(target.embed, target.lm_head)
            tau = greedy_tau(drafters, "weaver", args.eval_budget, *held)
        weaver.train()
        return {"step": step, "heldout_lk_loss": terms.loss.item(),
                "heldout_alpha": terms.alpha.mean().item(),
                f"heldout_greedy_tau_weaver{args.eval_budget}": tau}

    def loss_at(step: int):
        generator = step_generator(args.seed, step)
        rows = torch.randint(0, train.num_sequences, (args.batch,), generator=generator)
        anchors = sample_anchors(args.batch, args.anchors, args.prompt_len, length - block,
                                 generator)
        inputs = train_blocks.batch(rows, anchors)
        terms = lk_loss(inputs["p"], _logq(weaver, target, inputs))
        return terms.loss, {"alpha": terms.alpha.mean().item()}

    def save(step: int) -> None:
        metadata = {"target": str(args.target), "drafter": str(args.dflash), "steps": step,
                    "pool_retained_mass": pool_mass}
        save_weaver_safetensors(weaver, out, metadata=metadata)
        save_weaver_public(weaver, public_out, metadata=metadata)
        checkpoint.save(step, {"weaver": weaver}, optimizer, scheduler)

    run = run_training(
        params=weaver.parameters(), optimizer=optimizer, scheduler=scheduler, start=step,
        steps=args.steps, loss_at=loss_at, evaluate=evaluate, save=save,
        eval_every=args.eval_every, save_every=args.save_every, desc="train weaver",
    )
    summary = {"out": str(out), "public_out": str(public_out), "step": run.step,
               "train_loss": run.train_loss, "seconds": run.seconds,
               "heldout_pool_retained_mass": pool_mass, "heldout_greedy_tau": baselines,
               "history": run.history}
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}))
    return summary


if __name__ == "__main__":
    main()
