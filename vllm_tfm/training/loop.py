"""Training-loop plumbing shared by the commands: options, device and processes (torchrun),
optimiser, checkpoints, per-step RNG, and the loop itself (`train`).

One process or many: under `torchrun --nproc_per_node N` every process runs the same
command; `setup_runtime` joins the process group (NCCL on CUDA, gloo on CPU) and the
objective is wrapped in torch's DistributedDataParallel. Each step draws ONE global batch
from (seed, step) alone; it is cut into world x accumulate equal parts, process r taking
parts r, r + world, ..., so any number of processes and accumulation steps average the
same examples into the same gradient (the mean of equal-size part means is the global
mean): results agree with a one-process run up to the order of the reductions.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import math
import os
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm


def add_run_args(parser: argparse.ArgumentParser, *, steps: int, lr: float,
                 weight_decay: float, warmup: int, save_every: int, batch: int) -> None:
    """The options every training command shares: schedule, batch, evaluation, resumable
    state, device, seed."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--weight-decay", type=float, default=weight_decay)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--batch", type=int, default=batch,
                        help="global batch per optimiser step (all processes together)")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="micro-batches per process per step (gradient accumulation)")
    parser.add_argument("--eval-every", type=int, default=250, help="0: only at the end")
    parser.add_argument("--save-every", type=int, default=save_every)
    parser.add_argument("--checkpoint", help="resumable state (default: <out>.ckpt)")
    add_device_args(parser)
    parser.add_argument("--seed", type=int, default=0)


def add_device_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:i]")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads")


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


@dataclass(frozen=True)
class Runtime:
    """This process's place in the run: its device, rank and the number of processes."""

    device: torch.device
    rank: int = 0
    world: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def autocast(self):
        """bf16 autocast on CUDA (fp32 master weights); CPU runs stay fp32."""
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """`values` averaged over the processes."""
        if self.world > 1:
            values = values.to(self.device)
            dist.all_reduce(values)
            values = values / self.world
        return values


def is_main_process() -> bool:
    """False on every torchrun process but rank 0."""
    return not dist.is_initialized() or dist.get_rank() == 0


def setup_runtime(device: str, threads: int) -> Runtime:
    """The device (`setup_device`) and, under torchrun (WORLD_SIZE > 1), the process
    group: NCCL with one GPU per process (cuda:LOCAL_RANK) on CUDA, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    resolved = setup_device(device, threads)
    if world == 1:
        return Runtime(resolved)
    if resolved.type == "cuda":
        resolved = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(resolved)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if resolved.type == "cuda" else "gloo")
        atexit.register(dist.destroy_process_group)
    return Runtime(resolved, dist.get_rank(), dist.get_world_size())


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


def seeded_generator(*keys: Any) -> torch.Generator:
    """A CPU generator that depends on `keys` only (their str forms, in order)."""
    digest = hashlib.sha256(":".join(str(k) for k in keys).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def step_generator(seed: int, step: int) -> torch.Generator:
    """A CPU generator for one training step: batches depend on (seed, step) only, so a
    resumed run (or a run on another number of processes) draws exactly the batches the
    uninterrupted one-process run would have."""
    return seeded_generator(seed, step)


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
            "extra": json.dumps(extra or {}),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save(payload, tmp)
        tmp.replace(self.path)

    def restore(self, modules: dict[str, nn.Module], optimizer,
                scheduler) -> tuple[int, dict[str, Any]]:
        """Load the saved state into the given objects; returns the saved step and
        `extra` ((0, {}) if no checkpoint file exists)."""
        if not self.path.is_file():
            return 0, {}
        payload = torch.load(self.path, map_location="cpu", weights_only=True)
        missing = sorted(set(modules) - set(payload["modules"]))
        if missing:
            raise ValueError(f"{self.path}: checkpoint holds no state for {missing}")
        for name, module in modules.items():
            module.load_state_dict(payload["modules"][name])
        optimizer.load_state_dict(payload["optimizer"])
        scheduler.load_state_dict(payload["scheduler"])
        return int(payload["step"]), json.loads(payload["extra"])


def sibling(out: str | Path, suffix: str) -> Path:
    """`<out><suffix>` beside the output (never inside a model directory vLLM reads)."""
    out = Path(out)
    return out.with_name(out.name + suffix)


@dataclass
class Job:
    """What a training command hands `train`.

    name: progress label and the model's key in the checkpoint.
    model: the trained module (its parameters are optimised and checkpointed).
    objective: a module holding `model` whose forward(part) returns (loss, shown): the
        mean loss over a batch part and scalar tensors for the progress bar.
    sample: step -> the step's global batch, a dict of CPU tensors whose first dimension
        is --batch (drawn from `step_generator`).
    evaluate: step -> held-out estimates (a JSON-able dict); main process only.
    export: step -> write the model's output files; main process only.
    """

    name: str
    model: nn.Module
    objective: nn.Module
    sample: Callable[[int], dict[str, torch.Tensor]]
    evaluate: Callable[[int], dict]
    export: Callable[[int], None]


@dataclass
class TrainingRun:
    """What `train` did: the last step, the last training loss, the seconds spent in the
    loop, the evaluations (each a dict with its "step"), [step, loss] per step, and the
    wall seconds of each optimiser step this run made (evaluation and saving excluded)."""

    step: int
    train_loss: float
    seconds: float
    history: list[dict] = field(default_factory=list)
    losses: list[list[float]] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)

    def summary(self, **fields) -> dict:
        """`fields`, then the run's numbers; seconds_per_step is the median over this run's
        steps after the first (which allocates and warms up)."""
        timed = self.step_seconds[1:] or self.step_seconds
        return {**fields, "step": self.step, "train_loss": self.train_loss,
                "seconds": self.seconds,
                "seconds_per_step": statistics.median(timed) if timed else None,
                "history": self.history}


def _parts(batch: dict[str, torch.Tensor], total: int, runtime: Runtime, accumulate: int):
    """This process's `accumulate` micro-batches of the global batch (see module doc)."""
    size = total // (runtime.world * accumulate)
    for micro in range(accumulate):
        start = (micro * runtime.world + runtime.rank) * size
        yield {name: value[start : start + size] for name, value in batch.items()}


def train(args: argparse.Namespace, runtime: Runtime, job: Job, out: str | Path) -> TrainingRun:
    """Run `job` from its checkpoint (or step 0) to --steps.

    Each step: the global batch, its parts through the (DDP-wrapped) objective under
    `runtime.autocast`, backward of loss / accumulate (DDP averages over processes), the
    gradient norm clipped to 1, optimiser and schedule step. `evaluate` (in fp32: the
    engine's drafting code it calls expects one dtype) runs before a fresh run, every --eval-every steps (0: never) and at the end, printed as one JSON
    line; every --save-every steps and at the end: `export`, the checkpoint
    (`--checkpoint`, default <out>.ckpt), and the curves: <out>.training.json and
    <out>.training.png (loss and held-out estimates over steps).
    """
    parts = runtime.world * args.accumulate
    if args.batch < 1 or args.accumulate < 1 or args.batch % parts:
        raise ValueError(
            f"--batch ({args.batch}) must be a positive multiple of processes "
            f"({runtime.world}) x --accumulate ({args.accumulate})"
        )
    params = [p for p in job.model.parameters() if p.requires_grad]
    optimizer, scheduler = make_optimizer(params, args.lr, args.weight_decay, args.warmup,
                                          args.steps)
    checkpoint = Checkpoint(args.checkpoint or sibling(out, ".ckpt"))
    start, extra = checkpoint.restore({job.name: job.model}, optimizer, scheduler)
    run = TrainingRun(start, float("nan"), 0.0, extra.get("history", []),
                      extra.get("losses", []))
    objective = job.objective
    if runtime.world > 1:
        ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        objective = nn.parallel.DistributedDataParallel(job.objective, device_ids=ids)

    def record(step: int) -> None:
        if runtime.is_main:
            run.history.append(job.evaluate(step))
            tqdm.write(json.dumps(run.history[-1]))
        runtime.barrier()

    def save(step: int) -> None:
        if runtime.is_main:
            job.export(step)
            checkpoint.save(step, {job.name: job.model}, optimizer, scheduler,
                            {"history": run.history, "losses": run.losses})
            write_curves(out, run.history, run.losses)
        runtime.barrier()

    if start == 0:
        record(0)
    started = time.perf_counter()
    bar = tqdm(total=args.steps, initial=start, desc=f"train {job.name}",
               disable=not runtime.is_main)
    step = start
    while step < args.steps:
        step_started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        tally = None
        micro_batches = list(_parts(job.sample(step), args.batch, runtime, args.accumulate))
        for index, part in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            sync = nullcontext() if last or runtime.world == 1 else objective.no_sync()
            with sync:
                with runtime.autocast():
                    loss, shown = objective(part)
                (loss / args.accumulate).backward()
            values = torch.stack([loss.detach().float(), *(v.detach().float().reshape(())
                                                          for v in shown.values())])
            tally = values if tally is None else tally + values
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        step += 1
        means = runtime.mean(tally / args.accumulate).tolist()  # waits for the device
        run.step_seconds.append(time.perf_counter() - step_started)
        run.losses.append([step, means[0]])
        bar.update(1)
        bar.set_postfix(loss=f"{means[0]:.3f}",
                        **{k: f"{v:.3f}" for k, v in zip(shown, means[1:])})
        finished = step == args.steps
        if finished or (args.eval_every and step % args.eval_every == 0):
            record(step)
        if finished or (args.save_every and step % args.save_every == 0):
            save(step)
    bar.close()
    run.step = step
    run.train_loss = run.losses[-1][1] if run.losses else float("nan")
    run.seconds = time.perf_counter() - started
    return run


def report(runtime: Runtime, summary: dict) -> dict:
    """A command's summary, printed as one JSON line (its history aside) by the main process."""
    if runtime.is_main:
        print(json.dumps({k: v for k, v in summary.items() if k != "history"}))
    return summary


def write_curves(out: str | Path, history: list[dict], losses: list[list[float]]) -> None:
    """<out>.training.json (both lists) and <out>.training.png: training loss per step
    with the held-out losses, and the held-out acceptance estimates (tau, alpha)."""
    sibling(out, ".training.json").write_text(
        json.dumps({"history": history, "losses": losses}) + "\n", encoding="utf-8")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    if losses:
        steps, values = zip(*losses)
        left.plot(steps, values, lw=0.8, label="train loss")
    numeric = sorted({key for row in history for key, value in row.items()
                      if key != "step" and isinstance(value, (int, float))})
    for key in numeric:
        points = [(row["step"], row[key]) for row in history if key in row]
        axis = right if ("tau" in key or "alpha" in key) else left
        axis.plot(*zip(*points), marker="o", label=key)
    left.set(xlabel="step", ylabel="loss", title="loss")
    right.set(xlabel="step", title="held-out acceptance estimates")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sibling(out, ".training.png"), dpi=100)
    plt.close(fig)
