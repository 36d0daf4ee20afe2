"""End-to-end throughput in vLLM: no speculation vs vLLM's dflash vs dflash_tfm.

Runs each configuration in one engine after another (same process), on the
same prompts, and prints tokens/s and the mean accepted length tau (tokens
per verify step, bonus included, from vLLM's spec-decode counters).

    python tools/bench_e2e.py                  # trained tiny family, held-out prompts, CPU
    python tools/bench_e2e.py --family random --budgets 16 64 --max-tokens 128

Prompts are --num-prompts windows of --prompt-len tokens from the held-out standard-library
modules (vllm_tfm/training/data.py), given to vLLM as token ids. --breakdown also prints where
each engine step's time goes (target forward, DFlash pass, tree build, the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from vllm_tfm.tiny.engine_runs import timed_run
from vllm_tfm.tiny.family import build_family, trained_family

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def configurations(drafter: Path, weaver: Path, budgets: list[int],
                   trees: list[str]) -> list[tuple[str, dict | None]]:
    """(label, speculative_config) pairs, baselines first."""
    configs: list[tuple[str, dict | None]] = [
        ("no speculation", None),
        ("vLLM dflash (chain, 15)", {"method": "dflash", "model": str(drafter),
                                     "num_speculative_tokens": 15}),
    ]
    for tree in trees:
        for budget in budgets:
            config = {"method": "dflash_tfm", "model": str(drafter), "tree": tree,
                      "num_speculative_tokens": budget}
            if tree == "weaver":
                config["weaver"] = str(weaver)
            configs.append((f"dflash_tfm {tree} B={budget}", config))
    return configs


class StepBreakdown:
    """Wall time of the stages of each engine step, from timers around the model runner's
    and the tree proposer's methods (the engine must run in this process)."""

    STAGES = {
        "forward": ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "_model_forward"),
        "execute": ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "execute_model"),
        "sample": ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "sample_tokens"),
        "propose": ("vllm_tfm.vllm_glue.proposer:TreeProposer", "propose"),
        "tree": ("vllm_tfm.vllm_glue.proposer:TreeProposer", "_grow_trees"),
    }

    def __init__(self):
        import importlib

        self.seconds = dict.fromkeys(self.STAGES, 0.0)
        self.steps = 0
        self._originals = []
        for stage, (owner, name) in self.STAGES.items():
            module, cls = owner.split(":")
            cls = getattr(importlib.import_module(module), cls)
            original = getattr(cls, name)
            self._originals.append((cls, name, original))
            setattr(cls, name, self._timed(stage, original))

    def _timed(self, stage: str, original):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[stage] += time.perf_counter() - started
                self.steps += stage == "execute"

        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.STAGES, 0.0)
        self.steps = 0

    def per_step_ms(self) -> dict[str, float]:
        """ms per engine step: target forward, DFlash pass, tree build, the rest of the
        step (input preparation, verification, commit, bookkeeping). The DFlash pass and
        tree build are the tree proposer's: vLLM's own dflash drafting lands in the rest."""
        t = {stage: 1000 * value / max(self.steps, 1) for stage, value in self.seconds.items()}
        return {"target forward": t["forward"], "DFlash pass": t["propose"] - t["tree"],
                "tree build": t["tree"],
                "rest": t["execute"] + t["sample"] - t["forward"] - t["propose"]}

    def close(self) -> None:
        for cls, name, original in self._originals:
            setattr(cls, name, original)


def _tau(tau: float | None) -> str:
    return "-" if tau is None else f"{tau:.2f}"


def main(argv: list[str] | None = None) -> None:
    from vllm_tfm.training.data import heldout_prompts, load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="trained",
                        help="'trained' (models/tiny_trained, default), 'random' (the tiny "
                        "family built here) or a trained family directory")
    parser.add_argument("--dflash", type=Path, default=None,
                        help="DFlash drafter directory (default: the family's)")
    parser.add_argument("--weaver", type=Path, default=None,
                        help="Weaver checkpoint (default: the family's)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[7, 33, 64])
    parser.add_argument("--trees", nargs="+", default=["weaver", "ddtree", "chain"])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the stages of each engine step (ms per step)")
    args = parser.parse_args(argv)

    if args.family == "random":
        family = build_family()
    else:
        family = trained_family(*(() if args.family == "trained" else (args.family,)))
    windows = heldout_prompts(load_tokenizer(family.target), args.num_prompts, args.prompt_len)
    prompts = [{"prompt_token_ids": window.tolist()} for window in windows]
    rows = []
    drafter = args.dflash or family.dflash
    weaver = args.weaver or family.weaver
    breakdown = StepBreakdown() if args.breakdown else None
    for label, config in configurations(drafter, weaver, args.budgets, args.trees):
        result = timed_run(family.target, config, prompts, args.max_tokens, args.temperature,
                           breakdown=breakdown)
        rows.append({"config": label, "tokens_per_s": result["tokens_per_s"],
                     "tau": result["tau"], "steps_ms": result.get("steps_ms")})
        print(f"{label:32s} {result['tokens_per_s']:9.1f} tok/s   tau {_tau(result['tau'])}",
              flush=True)
    base = rows[0]["tokens_per_s"]
    print("\n| configuration | tokens/s | speed-up | tau |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['config']} | {row['tokens_per_s']:.1f} | "
              f"{row['tokens_per_s'] / base:.2f}x | {_tau(row['tau'])} |")
    if breakdown:
        breakdown.close()
        stages = list(rows[0]["steps_ms"])
        print("\nms per engine step (the whole batch):\n")
        print("| configuration | " + " | ".join(stages) + " |\n|---|"
              + "--:|" * len(stages))
        for row in rows:
            print(f"| {row['config']} | "
                  + " | ".join(f"{row['steps_ms'][stage]:.1f}" for stage in stages) + " |")
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
