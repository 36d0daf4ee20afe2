"""Training-loop plumbing shared by the tools: device, optimiser, checkpoints, per-step RNG."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from tqdm import tqdm


def add_run_args(parser: argparse.ArgumentParser, *, steps: int, lr: float,
                 weight_decay: float, warmup: int, save_every: int) -> None:
    """The options every training tool shares: schedule, evaluation, device, seed."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--weight-decay", type=float, default=weight_decay)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--eval-every", type=int, default=250, help="0: only at the end")
    parser.add_argument("--save-every", type=int, default=save_every)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads")
    parser.add_argument("--seed", type=int, default=0)


def fill_family_defaults(args: argparse.Namespace, *, trained: bool = False,
                         **fields: str) -> None:
    """Fill unset path options from the tiny family: the committed trained one when
    `trained`, else the random one (built on first use).

    ``fields`` maps an option's attribute to the family member it defaults to,
    e.g. ``target="target", init="dflash"``.
    """
    if all(getattr(args, name) is not None for name in fields):
        return
    from vllm_tfm.tiny import family as tiny_family

    family = tiny_family.trained_family() if trained else tiny_family.build_family()
    for name, member in fields.items():
        if getattr(args, name) is None:
            setattr(args, name, str(getattr(family, member)))


def setup_device(name: str, threads: int) -> torch.device:
    """"auto" (CUDA when present, else CPU), "cpu" or "cuda[:i]".

    On a CPU, `threads` intra-op threads: on a small machine shared with other jobs,
    OpenMP workers that wait for a busy core make tiny ops (transformers' depthwise GDN
    conv) a hundred times slower, so the tools default to one.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if not (name == "cpu" or name.startswith("cuda")):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:i]', got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    device = torch.device(name)
    if device.type == "cpu":
        torch.set_num_threads(threads)
    return device


def make_optimizer(params, lr: float, weight_decay: float, warmup: int, total_steps: int):
    """AdamW (betas 0.9 / 0.95) with linear warm-up over `warmup` steps, then a cosine
    decay to 10% of `lr` at `total_steps`."""
    if lr <= 0 or total_steps < 1 or warmup < 0:
        raise ValueError(
            f"need lr > 0, total_steps >= 1, warmup >= 0; got {lr}, {total_steps}, {warmup}"
        )
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def step_generator(seed: int, step: int) -> torch.Generator:
    """A CPU generator for one training step: batches depend on (seed, step) only, so a
    resumed run draws exactly the batches the uninterrupted run would have."""
    digest = hashlib.sha256(f"{seed}:{step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


class Checkpoint:
    """A resumable training state in one file (torch.save; read with weights_only=True).

    Holds the step, the trained modules' state dicts, optimiser and scheduler states and
    a small JSON-able `extra` dict.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def save(self, step: int, modules: dict[str, nn.Module], optimizer, scheduler,
             extra: dict[str, Any] | None = None) -> None:
        payload = {
            "step": step,
            "modules": {name: module.state_dict() for name, module in modules.items()},
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "extra": extra or {},
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save(payload, tmp)
        tmp.replace(self.path)

    def restore(self, modules: dict[str, nn.Module], optimizer, scheduler) -> int:
        """Load the saved state into the given objects; returns the saved step (0 if no
        checkpoint file exists)."""
        if not self.path.is_file():
            return 0
        payload = torch.load(self.path, map_location="cpu", weights_only=True)
        missing = sorted(set(modules) - set(payload["modules"]))
        if missing:
            raise ValueError(f"{self.path}: checkpoint holds no state for {missing}")
        for name, module in modules.items():
            module.load_state_dict(payload["modules"][name])
        optimizer.load_state_dict(payload["optimizer"])
        scheduler.load_state_dict(payload["scheduler"])
        return int(payload["step"])


def default_checkpoint(out: str | Path) -> Path:
    """`<out>.ckpt` beside the output (never inside a model directory that vLLM reads)."""
    out = Path(out)
    return out.with_name(out.name + ".ckpt")


@dataclass
class TrainingRun:
    """What `run_training` did: the last step, the last training loss, the seconds spent
    in the loop and the evaluations made (each a dict with its "step")."""

    step: int
    train_loss: float
    seconds: float
    history: list[dict] = field(default_factory=list)


def run_training(
    *,
    params,
    optimizer,
    scheduler,
    start: int,
    steps: int,
    loss_at: Callable[[int], tuple[torch.Tensor, dict[str, float]]],
    evaluate: Callable[[int], dict],
    save: Callable[[int], None],
    eval_every: int,
    save_every: int,
    desc: str,
) -> TrainingRun:
    """The loop every training tool runs, from step `start` to `steps`.

    Each step: `loss_at(step)` gives the loss and values for the progress bar; backward,
    gradient norm clipped to 1 over `params`, optimiser and schedule step. `evaluate(step)`
    runs before a fresh run (start 0), every `eval_every` steps (0: never) and at the end,
    its result printed as one JSON line; `save(step)` every `save_every` steps and at the
    end.
    """
    params = list(params)
    history = []

    def record(step: int) -> None:
        history.append(evaluate(step))
        tqdm.write(json.dumps(history[-1]))

    if start == 0:
        record(0)
    started = time.perf_counter()
    bar = tqdm(total=steps, initial=start, desc=desc)
    loss = torch.tensor(float("nan"))
    step = start
    while step < steps:
        loss, shown = loss_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", **{k: f"{v:.3f}" for k, v in shown.items()})
        finished = step == steps
        if finished or (eval_every and step % eval_every == 0):
            record(step)
        if finished or (save_every and step % save_every == 0):
            save(step)
    bar.close()
    return TrainingRun(step, loss.item(), time.perf_counter() - started, history)
