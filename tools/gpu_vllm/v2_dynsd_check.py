"""The batch-size-aware budget on model runner V2 (vLLM's dynamic speculative decoding) on
a CUDA GPU, inside vLLM 0.33's Python code (`tools/gpu_vllm/run_v2_tree.sh
5-budget-by-batch` runs it).

    python3 tools/gpu_vllm/v2_dynsd_check.py --models DIR --out OUT [--max-tokens 32]

The tiny models of `tools/gpu_e2e.py build DIR`, V2 with FULL_DECODE_ONLY graphs, at most 4
requests running. Engines: no speculation, then dflash_tfm of num_speculative_tokens 16
whose rule is k = 16 for one request and 8 from two: weaver with the rule given as vLLM's
own `num_speculative_tokens_per_batch_size` [(1, 1, 16), (2, 64, 8)], ddtree with it given
as the plugin's `budget_by_batch` [[1, 16], [64, 8]]. Each engine generates greedily, in
turn, one prompt alone (k = 16 every step), 4 prompts together (k = 8), and all 8 prompts
staggered (lengths max_tokens, max_tokens - 4, ...: the batch shrinks and refills, k
changes between steps, prompt chunks join running trees); then one seeded sampled run.

Checks (exit 1 if one fails), per dflash_tfm engine: each greedy output equal to no
speculation's up to bf16 ties (margin < TIE_MARGIN at the first difference); target
forwards of tree steps replayed FULL graphs of both query lengths 17 and 9 (counted per
query length, dummy runs left out) and never a PIECEWISE one; the tree round's own draft
graphs replayed for both k (counted per k); the sampled run completed. A table is printed
last and written to OUT/v2_dynsd.md (+ .json).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

BUDGET = 16
SCHEDULE = [(1, 1, 16), (2, 64, 8)]
QUERY_LENGTHS = (17, 9)
COUNTS: collections.Counter = collections.Counter()


def count_graphs_by_length() -> None:
    """Count V2's target forwards of tree steps by (CUDA-graph mode, query length), and the
    tree speculator's draft-graph replays by round budget k; dummy runs left out."""
    from vllm.v1.worker.gpu.spec_decode.dflash.cudagraph import DFlashCudaGraphManager

    from vllm_tfm.tiny.gpu_checks import count_v2_graph_dispatch
    from vllm_tfm.vllm_glue.v2.speculator import TreeSpeculator

    count_v2_graph_dispatch(COUNTS, lambda descriptor, tree_step: (
        f"tree steps {descriptor.cg_mode.name} q{descriptor.uniform_token_count}"
        if tree_step else None))
    manager_budget: dict[int, int] = {}  # id(graph manager) -> its round budget

    init_managers = TreeSpeculator.init_cudagraph_manager

    def init_cudagraph_manager(self, cudagraph_mode):
        init_managers(self, cudagraph_mode)
        manager_budget.update({id(m): k for k, m in self.draft_graphs.items()})

    run_fullgraph = DFlashCudaGraphManager.run_fullgraph

    def replay(self, desc):
        if id(self) in manager_budget:
            COUNTS[f"draft graph replays k{manager_budget[id(self)]}"] += 1
        return run_fullgraph(self, desc)

    TreeSpeculator.init_cudagraph_manager = init_cudagraph_manager
    DFlashCudaGraphManager.run_fullgraph = replay


def configurations(models: Path) -> list[tuple[str, dict | None]]:
    dflash = {"model": str(models / "dflash"), "attention_backend": "TRITON_ATTN",
              "method": "dflash_tfm", "num_speculative_tokens": BUDGET}
    return [
        ("no speculation", None),
        ("weaver, vLLM schedule", {**dflash, "tree": "weaver",
                                   "weaver": str(models / "weaver.pth"),
                                   "num_speculative_tokens_per_batch_size": SCHEDULE}),
        ("ddtree, budget_by_batch", {**dflash, "tree": "ddtree",
                                     "budget_by_batch": [[1, 16], [64, 8]]}),
    ]


def phases(prompts: tuple[str, ...], max_tokens: int) -> dict[str, tuple[list, list]]:
    """(prompts, new tokens each) per phase."""
    staggered = [max(8, max_tokens - 4 * i) for i in range(len(prompts))]
    return {"1 prompt": ([prompts[0]], [max_tokens]),
            "4 prompts": (list(prompts[:4]), [max_tokens] * 4),
            "8 staggered": (list(prompts), staggered)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    from vllm import SamplingParams

    from vllm_tfm.tiny.engine_runs import PROMPTS, compare_greedy, timed_generate
    from vllm_tfm.tiny.gpu_checks import on_tiny_engine, set_harness_env
    from vllm_tfm.vllm_glue import register

    set_harness_env()  # V2's sampler imports FlashInfer unless told not to

    register()
    count_graphs_by_length()
    runs = phases(PROMPTS, args.max_tokens)

    def generate(llm, logprobs: bool) -> dict:
        llm.generate(PROMPTS[:4], SamplingParams(max_tokens=8, ignore_eos=True),
                     use_tqdm=False)  # warm-up
        out = {}
        for name, (prompts, lengths) in runs.items():
            params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                     logprobs=2 if logprobs else None) for n in lengths]
            out[name] = timed_generate(llm, prompts, params)
        prompts, lengths = runs["8 staggered"]
        out["sampled"] = timed_generate(llm, prompts, [
            SamplingParams(temperature=1.0, seed=100 + i, max_tokens=n, ignore_eos=True)
            for i, n in enumerate(lengths)])
        return out

    rows, base, failed = [], None, False
    for label, config in configurations(args.models):
        started = time.perf_counter()
        before = collections.Counter(COUNTS)
        print(f"=== {label}", flush=True)
        try:
            result, start_s = on_tiny_engine(args.models, config, 4, "full-decode", "v2",
                                             lambda llm: generate(llm, config is None))
        except Exception as error:  # report it, keep the others
            import traceback

            traceback.print_exc()
            rows.append({"config": label, "error": f"{type(error).__name__}: {error}"})
            failed = True
            continue
        counts = {k: v - before.get(k, 0) for k, v in COUNTS.items() if v - before.get(k, 0)}
        row = {"config": label, "start_s": start_s, "seconds": time.perf_counter() - started,
               "counts": counts, "checks": []}
        if config is None:
            base = result
        else:
            for name in runs:
                compared = compare_greedy(base[name], result[name])
                equal = sum(r["matched"] == r["length"] for r in compared)
                ok = all(r.get("tie", True) for r in compared)
                row["checks"].append(f"{name}: {equal}/{len(compared)} equal"
                                     + ("" if ok else " NOT TIES"))
                failed |= not ok
            for q in QUERY_LENGTHS:
                if not counts.get(f"tree steps FULL q{q}"):
                    row["checks"].append(f"NO FULL REPLAY AT QUERY LENGTH {q}")
                    failed = True
            for k in (16, 8):
                if not counts.get(f"draft graph replays k{k}"):
                    row["checks"].append(f"NO DRAFT GRAPH REPLAY AT k {k}")
                    failed = True
            if any(name.startswith("tree steps PIECEWISE") for name in counts):
                row["checks"].append("TREE STEPS IN A PIECEWISE GRAPH")
                failed = True
            if not all(result["sampled"]["tokens"]):
                row["checks"].append("SAMPLED RUN INCOMPLETE")
                failed = True
        row["tau"] = {name: result[name]["tau"] for name in result}
        rows.append(row)
        print(f"    {row}", flush=True)

    lines = ["| engine | greedy vs no speculation | tau by phase | target forwards of tree "
             "steps / draft replays |", "|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['config']} | FAILED: {row['error'][:150]} | | |")
            continue
        taus = ", ".join(f"{k} {v:.2f}" for k, v in row["tau"].items() if v is not None)
        counts = ", ".join(f"{k} {v}" for k, v in sorted(row["counts"].items()))
        lines.append(f"| {row['config']} | {'; '.join(row['checks']) or '-'} | {taus or '-'} "
                     f"| {counts or '-'} |")
    text = "\n".join(lines) + "\n"
    (args.out / "v2_dynsd.md").write_text(text)
    (args.out / "v2_dynsd.json").write_text(json.dumps(rows, indent=1, default=str))
    print(text + ("FAILED" if failed else "PASSED"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
