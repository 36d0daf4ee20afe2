"""Train a DFlash drafter for a frozen target (DESIGN.md section 2).

    python tools/train_dflash.py --out artifacts/trained_tiny/dflash [--steps 1500] \
        [--target DIR] [--init DIR] [--device auto|cpu|cuda]

Recipe: random anchors p in the generated part of target-generated sequences (see
vllm_tfm/training/data.py for why the data are the target's own continuations); block
[x_p, MASK x 15] at positions p..p+15; the block sees the target's layer outputs at
positions < p (fc + hidden_norm, K/V prepended in every layer) and its own entries,
non-causally; entry k predicts x_{p+k} through the frozen target LM head, CE weighted by
w_k = exp(-(k-1)/7). AdamW, warm-up + cosine.

Defaults use the tiny family (vllm_tfm/tiny/family.py, built on demand): target, and the
family's random drafter as the starting point and the source of the config. The output
directory (config.json + bf16 model.safetensors, vLLM's names) loads with vLLM's
`dflash` method. A resumable state lives beside it (`<out>.ckpt`); a rerun with the
same --out continues from it, up to the new --steps. Every --eval-every steps the held-out
chain tau (greedy, exact on greedy continuations, see vllm_tfm/training/acceptance.py) and
held-out loss are printed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vllm_tfm.training import data
from vllm_tfm.training.acceptance import Drafters, greedy_tau
from vllm_tfm.training.dflash import DFlashDrafter, block_loss, sample_anchors
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="drafter directory to write")
    parser.add_argument("--target", help="target model directory (default: tiny family)")
    parser.add_argument("--init", help="drafter directory to start from (default: tiny family)")
    parser.add_argument("--data", help="continuation cache (default: <out>.data.pt)")
    parser.add_argument("--checkpoint", help="resumable state (default: <out>.ckpt)")
    data.add_continuation_args(parser)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--anchors", type=int, default=8, help="blocks per sequence")
    add_run_args(parser, steps=1500, lr=1e-3, weight_decay=0.01, warmup=50, save_every=250)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    fill_family_defaults(args, target="target", init="dflash")
    out = Path(args.out)
    device = setup_device(args.device, args.threads)
    target = Target(args.target, device)
    drafter = DFlashDrafter.load(args.init, target.hidden_size).to(device)
    layer_ids = target.check_layer_ids(drafter.target_layer_ids)
    spec = data.continuation_spec(args)
    block = drafter.block_size
    if args.new_tokens < block:
        raise ValueError(f"--new-tokens must be at least the block size {block}")
    data_path = Path(args.data) if args.data else out.with_name(out.name + ".data.pt")
    sets = data.load_or_build_continuations(data_path, target, args.target, spec)
    train, heldout = sets["train"], sets["heldout"]
    train_aux, _ = target.features(train.tokens, layer_ids)
    held_aux, held_final = target.features(heldout.tokens, layer_ids)
    length = train.tokens.shape[1]

    optimizer, scheduler = make_optimizer(
        drafter.parameters(), args.lr, args.weight_decay, args.warmup, args.steps
    )
    checkpoint = Checkpoint(args.checkpoint or default_checkpoint(out))
    step = checkpoint.restore({"dflash": drafter}, optimizer, scheduler)
    drafters = Drafters(target, drafter)
    held_anchors = sample_anchors(heldout.num_sequences, args.anchors, args.prompt_len,
                                  length - block, step_generator(args.seed, -1))

    def evaluate(step: int) -> dict:
        drafter.eval()
        with torch.no_grad():
            loss, correct = block_loss(drafter, held_aux.to(device), heldout.tokens.to(device),
                                       held_anchors.to(device), target.embed, target.lm_head)
        tau = greedy_tau(drafters, "chain", drafter.draft_depth, heldout.tokens, held_aux,
                         held_final, args.prompt_len)
        drafter.train()
        return {"step": step, "heldout_loss": loss.item(), "heldout_chain_tau": tau,
                "heldout_top1_by_k": [round(c, 3) for c in correct.tolist()]}

    def loss_at(step: int):
        generator = step_generator(args.seed, step)
        rows = torch.randint(0, train.num_sequences, (args.batch,), generator=generator)
        anchors = sample_anchors(args.batch, args.anchors, args.prompt_len, length - block,
                                 generator)
        loss, correct = block_loss(drafter, train_aux[rows].to(device),
                                   train.tokens[rows].to(device), anchors.to(device),
                                   target.embed, target.lm_head)
        return loss, {"top1_k1": correct[0].item()}

    def save(step: int) -> None:
        drafter.save(out)
        checkpoint.save(step, {"dflash": drafter}, optimizer, scheduler)

    drafter.train()
    run = run_training(
        params=drafter.parameters(), optimizer=optimizer, scheduler=scheduler, start=step,
        steps=args.steps, loss_at=loss_at, evaluate=evaluate, save=save,
        eval_every=args.eval_every, save_every=args.save_every, desc="train dflash",
    )
    summary = {"out": str(out), "step": run.step, "train_loss": run.train_loss,
               "seconds": run.seconds, "history": run.history}
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}))
    return summary


if __name__ == "__main__":
    main()
