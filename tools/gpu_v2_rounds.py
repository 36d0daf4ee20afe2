"""Graphed draft rounds on model runner V2, on a CUDA GPU inside vLLM 0.33's Python code: the
tree round runs inside vLLM's FULL draft graph (vllm_glue/v2/speculator.py). One call checks,
then times, then prints a table. On the H200 (device call carrying [".gpu-vllm-0.33.0"]):

    bash .gpu-vllm-0.33.0/setup.sh > /dev/null && PYTHONPATH=/tmp/vsrc:/tmp/site:$PWD \\
        python3 tools/gpu_v2_rounds.py --out $OUT

1. Check (tools/gpu_e2e.py's check, `--runner v2 --cudagraphs full-decode`, 32 tokens a
   prompt, 8 prompts): no speculation, dflash_tfm weaver B=7 and B=64, ddtree B=33 (as the
   deadline allows): greedy equal to no speculation up to bf16 ties, sampled runs complete,
   every tree kernel ran, tree steps replayed FULL target graphs, and, counted here, tree
   steps whose round replayed inside vLLM's draft graph (`draft rounds replayed`) against
   rounds run eagerly (`draft rounds eager`: batches without a captured draft size). A tree
   configuration without replayed rounds fails.
2. Time weaver B=64 at batch 1 and 8 (64 greedy tokens a prompt) with the round in the
   draft graph, then with the round run eagerly after the graphed DFlash forward (the V2
   speculator before graphed rounds, rebuilt here by `eager_rounds`): ms per engine step,
   ms of the speculator's `propose` per step (CUDA events: DFlash forward + round), tokens/s,
   mean accepted length, and whether the greedy tokens of the two engines are equal.

Writes OUT/check/gpu_e2e.{md,json}, OUT/v2_rounds.{md,json}. Exit status 1 when a check
failed. About 4-5 minutes on a fresh machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

REPLAYED, EAGER = "draft rounds replayed", "draft rounds eager"
CHECKED = ("weaver B=7", "weaver B=64", "ddtree B=33")
TIMED = "dflash_tfm weaver B=64"
# [use the eager-round speculator?]: read at call time, so both engines share the patches.
EAGER_ROUNDS = [False]


def count_draft_rounds(launches: collections.Counter) -> None:
    """Count a tree speculator's real (not dummy) proposals by where their round ran: a
    replay of vLLM's FULL draft graph, or ``_generate_draft`` called eagerly (while
    EAGER_ROUNDS[0], ``eager_rounds`` counts them)."""
    import torch
    from vllm.v1.worker.gpu.spec_decode.dflash.cudagraph import DFlashCudaGraphManager

    from vllm_tfm.vllm_glue.v2.speculator import TreeSpeculator

    proposing = []
    propose, replay = TreeSpeculator.propose, DFlashCudaGraphManager.run_fullgraph
    generate = TreeSpeculator._generate_draft

    def counted_propose(self, *args, dummy_run: bool = False, **kwargs):
        proposing.append(not dummy_run)
        try:
            return propose(self, *args, dummy_run=dummy_run, **kwargs)
        finally:
            proposing.pop()

    def counted_replay(self, desc):
        if proposing and proposing[-1] and not EAGER_ROUNDS[0]:
            launches[REPLAYED] += 1
        return replay(self, desc)

    def counted_generate(self, *args, **kwargs):
        if (proposing and proposing[-1] and not EAGER_ROUNDS[0]
                and not torch.cuda.is_current_stream_capturing()):
            launches[EAGER] += 1
        return generate(self, *args, **kwargs)

    TreeSpeculator.propose = counted_propose
    DFlashCudaGraphManager.run_fullgraph = counted_replay
    TreeSpeculator._generate_draft = counted_generate


def eager_rounds(launches: collections.Counter) -> None:
    """While EAGER_ROUNDS[0]: the speculator's draft graph keeps the pools and DFlash states
    in persistent buffers and the round runs eagerly after it, on the batch's real rows
    (counted as an eager round)."""
    import torch

    from vllm_tfm.drafting.draft_round import CandidatePools
    from vllm_tfm.vllm_glue.v2.speculator import TreeSpeculator

    init_round, grow, propose = (TreeSpeculator._init_round, TreeSpeculator._grow_trees,
                                 TreeSpeculator.propose)

    def init_with_buffers(self, context, device):
        init_round(self, context, device)
        shape = (self.max_num_reqs, self.num_speculative_steps, self.options.candidate_pool)
        self._eager_pools = CandidatePools(torch.zeros(shape, dtype=torch.int64, device=device),
                                           torch.zeros(shape, device=device))
        self._eager_states = torch.zeros(*shape[:2], self.hidden_size, dtype=self.dtype,
                                         device=device)

    def stage(self, num_reqs, pools, dflash_hidden):
        if not EAGER_ROUNDS[0]:
            return grow(self, num_reqs, pools, dflash_hidden)
        self._eager_pools.ids[:num_reqs] = pools.ids
        self._eager_pools.scores[:num_reqs] = pools.scores
        self._eager_states[:num_reqs] = dflash_hidden

    def propose_then_grow(self, input_batch, *args, dummy_run: bool = False,
                          num_speculative_tokens=None, **kwargs):
        drafts = propose(self, input_batch, *args, dummy_run=dummy_run,
                         num_speculative_tokens=num_speculative_tokens, **kwargs)
        n = input_batch.num_reqs
        if not EAGER_ROUNDS[0] or dummy_run or num_speculative_tokens == 0 or n == 0:
            return drafts
        launches[EAGER] += 1
        grow(self, n, CandidatePools(self._eager_pools.ids[:n], self._eager_pools.scores[:n]),
             self._eager_states[:n])
        return self.engine.trees.draft_tokens(input_batch.idx_mapping[:n])

    TreeSpeculator._init_round = init_with_buffers
    TreeSpeculator._grow_trees = stage
    TreeSpeculator.propose = propose_then_grow


def time_propose() -> list:
    """CUDA events around every real proposal of a tree speculator: [(start, end)]."""
    import torch

    from vllm_tfm.vllm_glue.v2.speculator import TreeSpeculator

    events = []
    propose = TreeSpeculator.propose

    def timed(self, *args, dummy_run: bool = False, **kwargs):
        if dummy_run:
            return propose(self, *args, dummy_run=dummy_run, **kwargs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        drafts = propose(self, *args, dummy_run=dummy_run, **kwargs)
        end.record()
        events.append((start, end))
        return drafts

    TreeSpeculator.propose = timed
    return events


def timing_runs(models: Path, launches, events, tokens: int) -> dict:
    """Both speculators at batch 1 and 8: {mode: {batch: measures}}."""
    import torch
    from vllm import SamplingParams

    from vllm_tfm.tiny.engine_runs import PROMPTS, timed_generate
    from vllm_tfm.tiny.gpu_checks import configurations, on_tiny_engine

    config = {label: spec for label, _, spec in configurations(models)}[TIMED]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)

    def measure(llm) -> dict:
        llm.generate(list(PROMPTS), SamplingParams(max_tokens=8, ignore_eos=True),
                     use_tqdm=False)
        by_batch = {}
        for batch in (1, len(PROMPTS)):
            before = collections.Counter(launches)
            events.clear()
            run = timed_generate(llm, list(PROMPTS[:batch]), params)
            torch.cuda.synchronize()
            steps = sum(count - before[name] for name, count in launches.items()
                        if " steps, graph mode " in name)
            propose_ms = [start.elapsed_time(end) for start, end in events]
            by_batch[batch] = {
                "steps": steps, "ms_per_step": 1e3 * run["seconds"] / max(steps, 1),
                "propose_ms": statistics.median(propose_ms) if propose_ms else None,
                "tokens_per_s": run["tokens_per_s"], "tau": run["tau"],
                "tokens": run["tokens"],
                "rounds": {key: launches[key] - before[key] for key in (REPLAYED, EAGER)}}
        return by_batch

    results = {}
    for mode, eager in (("round in the draft graph", False), ("round eager", True)):
        EAGER_ROUNDS[0] = eager
        started = time.perf_counter()
        try:
            results[mode], _ = on_tiny_engine(models, config, len(PROMPTS), "full-decode",
                                              "v2", measure)
        except Exception:  # the other mode's numbers still come back
            traceback.print_exc()
            results[mode] = {}
        print(f"=== {mode}: {time.perf_counter() - started:.0f} s", flush=True)
    EAGER_ROUNDS[0] = False
    return results


def report(results: dict) -> tuple[str, bool]:
    lines = [f"{TIMED}, model runner V2, FULL_DECODE_ONLY graphs (target and drafter), tiny "
             "models of tools/gpu_e2e.py build, greedy", "",
             "| round | batch | ms / step | propose ms / step | tok/s | tau | rounds replayed "
             "/ eager |", "|---|---|---|---|---|---|---|"]
    for mode, by_batch in results.items():
        for batch, row in by_batch.items():
            propose = "-" if row["propose_ms"] is None else f"{row['propose_ms']:.2f}"
            lines.append(
                f"| {mode} | {batch} | {row['ms_per_step']:.2f} | {propose} "
                f"| {row['tokens_per_s']:.1f} | {row['tau'] or 0:.2f} "
                f"| {row['rounds'][REPLAYED]} / {row['rounds'][EAGER]} |")
    graphed, eager = results.values()
    same = bool(graphed) and all(graphed[b]["tokens"] == eager.get(b, {}).get("tokens")
                                 for b in graphed)
    replayed = bool(graphed) and all(row["rounds"][REPLAYED] > 0 for row in graphed.values())
    lines += ["", f"greedy tokens equal between the two: {same}; the graphed engine's rounds "
              f"replayed at every batch: {replayed}"]
    return "\n".join(lines) + "\n", replayed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", type=Path, default=Path("/tmp/v2_rounds_models"))
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens a prompt, timed")
    parser.add_argument("--deadline-s", type=float, default=120.0,
                        help="start no check configuration after this many seconds")
    args = parser.parse_args(argv)
    from vllm_tfm.tiny.gpu_checks import run_all, set_harness_env

    set_harness_env()
    from vllm_tfm.tiny.gpu_models import build_models
    from vllm_tfm.tiny.launch_counts import LAUNCHES
    from vllm_tfm.vllm_glue import register

    register()
    if not (args.models / "target").is_dir():
        build_models(args.models)
    count_draft_rounds(LAUNCHES)
    eager_rounds(LAUNCHES)
    events = time_propose()
    check = args.out / "check"
    check.mkdir(parents=True, exist_ok=True)
    status = run_all(args.models, check, 32, args.deadline_s, False, list(CHECKED),
                     "full-decode", "v2")
    rows = json.loads((check / "gpu_e2e.json").read_text())
    for row in rows:
        if row["config"].startswith("dflash_tfm") and "launches" in row:
            rounds = {key: row["launches"].get(key, 0) for key in (REPLAYED, EAGER)}
            print(f"{row['config']}: {rounds}", flush=True)
            if not rounds[REPLAYED]:
                status = 1
    results = timing_runs(args.models, LAUNCHES, events, args.tokens)
    text, replayed = report(results)
    (args.out / "v2_rounds.md").write_text(text)
    (args.out / "v2_rounds.json").write_text(json.dumps(results, indent=1))
    print(text, flush=True)
    return 1 if status or not replayed else 0


if __name__ == "__main__":
    sys.exit(main())
