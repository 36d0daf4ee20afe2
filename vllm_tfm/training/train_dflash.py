"""Train a DFlash drafter from stored target features (DESIGN.md section 2).

    python tools/train_dflash.py --features work/features --init <drafter dir> \
        --out work/dflash [--steps 1500] [--batch 16] [--accumulate 1] [--device auto]
    torchrun --nproc_per_node 8 tools/train_dflash.py ...      (8 processes, same result)

Recipe: random anchors p in the generated part of target-generated sequences (see
vllm_tfm/training/data.py for why the data are the target's own continuations); block
[x_p, MASK x 15] at positions p..p+15; the block sees the target's layer outputs at
positions < p (fc + hidden_norm, K/V prepended in every layer) and its own entries,
non-causally; entry k predicts x_{p+k} through the frozen target LM head, CE weighted by
w_k = exp(-(k-1)/7). AdamW, warm-up + cosine; bf16 autocast on CUDA.

Reads the feature directory of tools/generate_features.py (the target itself is never
loaded: only its embedding and LM head, from the directory). --init is the drafter to
start from and the source of its config (default: the tiny family's random drafter); a
directory holding only config.json starts from a seeded random initialisation. The
output directory (config.json + bf16 model.safetensors, vLLM's names) loads with vLLM's
`dflash` method. Resumable (`<out>.ckpt`): a rerun with the same --out continues, up to
the new --steps. Every --eval-every steps the held-out chain tau (greedy, exact on greedy
continuations, see vllm_tfm/training/acceptance.py) and held-out loss are printed; curves
in `<out>.training.{json,png}`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from vllm_tfm.training.acceptance import Drafters, greedy_tau
from vllm_tfm.training.dflash import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    DFlashDrafter,
    block_loss,
    sample_anchors,
)
from vllm_tfm.training.features import FeatureSplit, StoredFeatures, TargetHead
from vllm_tfm.training.loop import (
    Job,
    add_run_args,
    fill_family_defaults,
    report,
    setup_runtime,
    step_generator,
    train,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="drafter directory to write")
    parser.add_argument("--features", required=True,
                        help="feature directory (tools/generate_features.py)")
    parser.add_argument("--init", help="drafter directory to start from; a config.json alone "
                        "starts from random weights (default: tiny family)")
    parser.add_argument("--anchors", type=int, default=8, help="blocks per sequence")
    add_run_args(parser, steps=1500, lr=1e-3, weight_decay=0.01, warmup=50, save_every=250,
                 batch=16)
    return parser.parse_args(argv)


class BlockObjective(nn.Module):
    """The DFlash block loss of a batch part {"rows", "anchors"} of the training split."""

    def __init__(self, drafter: DFlashDrafter, split: FeatureSplit, head: TargetHead):
        super().__init__()
        self.drafter = drafter
        self.split, self.head = split, head

    def forward(self, part: dict[str, torch.Tensor]):
        device = self.head.device
        rows = self.split.rows(part["rows"])
        loss, correct = block_loss(self.drafter, rows.aux.to(device), rows.tokens.to(device),
                                   part["anchors"].to(device), self.head.embed,
                                   self.head.lm_head)
        return loss, {"top1_k1": correct[0]}


def initial_drafter(init: str, target_hidden_size: int, seed: int) -> DFlashDrafter:
    """The drafter of `init`: its weights, or (config.json alone) a seeded initialisation."""
    directory = Path(init)
    if (directory / WEIGHTS_FILE).is_file() or not (directory / CONFIG_FILE).is_file():
        return DFlashDrafter.load(directory, target_hidden_size)
    config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    torch.manual_seed(seed)
    return DFlashDrafter(config, target_hidden_size)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    fill_family_defaults(args, init="dflash")
    out = Path(args.out)
    runtime = setup_runtime(args.device, args.threads)
    device = runtime.device
    stored = StoredFeatures.load(args.features, device)
    head, held = stored.head, stored.heldout
    drafter = initial_drafter(args.init, head.hidden_size, args.seed).to(device)
    block = drafter.block_size
    stored.check_drafter(drafter.target_layer_ids, block)
    anchor_range = (stored.prompt_len, stored.seq_len - block)
    held_anchors = sample_anchors(held.tokens.shape[0], args.anchors, *anchor_range,
                                  step_generator(args.seed, -1))
    drafters = Drafters(head, drafter)

    def sample(step: int) -> dict[str, torch.Tensor]:
        generator = step_generator(args.seed, step)
        rows = torch.randint(0, stored.train.num_sequences, (args.batch,), generator=generator)
        return {"rows": rows,
                "anchors": sample_anchors(args.batch, args.anchors, *anchor_range, generator)}

    def evaluate(step: int) -> dict:
        drafter.eval()
        with torch.no_grad():
            loss, correct = block_loss(drafter, held.aux.to(device), held.tokens.to(device),
                                       held_anchors.to(device), head.embed, head.lm_head)
            tau = greedy_tau(drafters, "chain", drafter.draft_depth, held.tokens, held.aux,
                             held.final, stored.prompt_len)
        drafter.train()
        return {"step": step, "heldout_loss": loss.item(), "heldout_chain_tau": tau,
                "heldout_top1_by_k": [round(c, 3) for c in correct.tolist()]}

    drafter.train()
    job = Job(name="dflash", model=drafter, objective=BlockObjective(drafter, stored.train, head),
              sample=sample, evaluate=evaluate, export=lambda step: drafter.save(out))
    return report(runtime, train(args, runtime, job, out).summary(out=str(out)))


if __name__ == "__main__":
    main()
