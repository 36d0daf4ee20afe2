"""Train the tiny Qwen3-Next target as a language model of Python sources.

    python tools/train_target.py --out artifacts/trained_tiny/target [--steps 3000] \
        [--batch 64] [--seq-len 256] [--config DIR] [--init DIR] [--device auto|cpu|cuda] \
        [--text stdlib|corpus:DIR]

Takes the architecture and tokenizer from --config (default: the tiny family's target)
and starts from transformers' own initialisation of that config (seeded by --seed), or
from the weights in --init. (The family's random target is built to look like a trained
model to the engine, peaky logits of std 8 included: as a starting point its loss is
~40 nats.) Minimises next-token cross-entropy on random token windows of the training
modules (vllm_tfm/training/data.py), or of a site-packages corpus's training packages
(`--text corpus:DIR`, vllm_tfm/training/corpus.py); the held-out modules or packages give
the eval loss. The summary states the training text's size in tokens and how many the run
read (`epochs`).
transformers runs the model (PyTorch GDN path; fla hidden), fp32 weights, bf16 autocast
on CUDA; several processes through torchrun (vllm_tfm/training/loop.py). AdamW, warm-up + cosine. Writes a transformers model directory in bf16 with the
--config's tokenizer files (what tiny_family's target directory holds); resumable state in
`<out>.ckpt`. On this CPU only smoke runs fit; the real run is meant for one GPU (about
20 minutes).
"""

from __future__ import annotations

import argparse
import copy
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vllm_tfm.training import corpus, data
from vllm_tfm.training.loop import (
    Job,
    add_run_args,
    fill_family_defaults,
    report,
    setup_runtime,
    step_generator,
    train,
)
from vllm_tfm.training.target import load_causal_lm

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="model directory to write")
    parser.add_argument("--config", help="model directory whose config and tokenizer are "
                        "used (default: the tiny family's target)")
    parser.add_argument("--init", help="model directory whose weights to start from "
                        "(default: a fresh initialisation)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--text", default="stdlib",
                        help=f"training text: stdlib or {corpus.SOURCE_PREFIX}DIR")
    add_run_args(parser, steps=3000, lr=3e-3, weight_decay=0.1, warmup=100, save_every=500,
                 batch=64)
    return parser.parse_args(argv)


class NextTokenObjective(nn.Module):
    """Mean next-token cross-entropy of a batch part {"ids": [B, S + 1] windows}."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, part: dict[str, torch.Tensor]):
        ids = part["ids"].to(self.model.device)
        logits = self.model(input_ids=ids[:, :-1]).logits
        return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten()), {}


def initial_model(config_dir: Path, init: Path | None, seed: int, device: torch.device):
    """fp32 model in train mode: the weights of `init`, else a fresh seeded initialisation
    of `config_dir`'s config."""
    if init is not None:
        return load_causal_lm(init, device, torch.float32).train()
    return load_causal_lm(config_dir, device, torch.float32, random_weights=True,
                          seed=seed).train()


def save_model(model, config_dir: Path, out: Path) -> None:
    """A bf16 copy of `model` in a transformers directory, with config_dir's tokenizer."""
    copy_ = copy.deepcopy(model).to(torch.bfloat16)
    copy_.config.dtype = torch.bfloat16
    copy_.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (config_dir / name).is_file():
            shutil.copyfile(config_dir / name, out / name)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.text != "stdlib" and not args.text.startswith(corpus.SOURCE_PREFIX):
        raise ValueError(f"--text must be stdlib or {corpus.SOURCE_PREFIX}DIR, got {args.text!r}")
    fill_family_defaults(args, config="target")
    config_dir, out = Path(args.config), Path(args.out)
    runtime = setup_runtime(args.device, args.threads)
    model = initial_model(config_dir, args.init and Path(args.init), args.seed, runtime.device)
    vocab = model.config.vocab_size
    windows = data.prompt_windows(args.text, "train", config_dir, vocab)
    held = data.prompt_windows(args.text, "heldout", config_dir, vocab).sample(
        args.eval_batches * args.batch, args.seq_len + 1, step_generator(args.seed, -1)
    )
    objective = NextTokenObjective(model)

    def evaluate(step: int) -> dict:
        model.eval()
        with torch.no_grad():
            losses = [objective({"ids": batch})[0].item() for batch in held.split(args.batch)]
        model.train()
        return {"step": step, "heldout_loss": sum(losses) / len(losses)}

    def sample(step: int) -> dict[str, torch.Tensor]:
        return {"ids": windows.sample(args.batch, args.seq_len + 1,
                                      step_generator(args.seed, step))}

    job = Job(name="target", model=model, objective=objective, sample=sample,
              evaluate=evaluate, export=lambda step: save_model(model, config_dir, out))
    read = args.steps * args.batch * args.seq_len
    return report(runtime, train(args, runtime, job, out).summary(
        out=str(out), text_tokens=windows.num_tokens, tokens_read=read,
        epochs=read / windows.num_tokens,
        parameters=sum(p.numel() for p in model.parameters())))


if __name__ == "__main__":
    main()
