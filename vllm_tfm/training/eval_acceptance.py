"""Mean accepted length of chain DFlash, DDTree(B) and Weaver(B) trees on a prompt set.

    python tools/eval_acceptance.py --out artifacts/eval/tiny_trained.json \
        [--target DIR --dflash DIR --weaver PTH|DIR] [--prompts FILE] \
        [--budgets 8 16 32 64 128] [--temperatures 0 1] \
        [--tree-draws deterministic sampled]

Target, drafter and Weaver not given come from --family: the committed trained tiny
family (models/tiny_trained, the default) or the random one (vllm_tfm/tiny/family.py);
`--weaver none` evaluates without "weaver" rows.

Each (temperature, tree, budget) decodes every prompt for --max-new-tokens tokens with
the engine's draft round and verifiers (vllm_tfm/training/acceptance.py: the target scores
every tree node exactly, fp32 transformers; greedy verification at T=0, target-only at
T>0). The chain is the DFlash block's argmax path (budget = --chain-budget, default the
drafter's 15 positions). As in the engine, a budget below 15 also shortens the DFlash
block to `budget` masks. At T>0, `--tree-draws sampled` adds rows of trees whose children
are sampled (Weaver: grown best-first from its q over the pool; DDTree: its shape, drawn
from the marginals) verified by traversal, the engine's other path for sampled requests; the summary's "auto" entries
are what the engine's `verify: "auto"` picks at each temperature
(`options.AUTO_SAMPLED_TREE_MIN_TEMPERATURE`).

Reported per configuration: tau = completion tokens of verification steps / steps
(bonus included), acceptance by depth (share of steps accepting >= d drafted tokens),
and the target mass kept by the top-512 pool along the accepted path (mean, 5% tail,
mean by depth). Writes the JSON and a PNG beside it (tau vs budget; acceptance by depth
at the reference budget). --prompts is a JSON list of strings; by default
--num-prompts windows of the held-out stdlib modules (vllm_tfm/training/data.py), or
with --corpus of a built corpus's held-out packages (vllm_tfm/training/corpus.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_tfm.drafting.builders import (
    DDTREE_SAMPLED_FIRST_RANK_EXPONENT,
    SAMPLED_FIRST_RANK_EXPONENT,
)
from vllm_tfm.drafting.weaver_checkpoint import load_weaver
from vllm_tfm.options import (AUTO_SAMPLED_TREE_MIN_TEMPERATURE, MAX_EXPAND_WIDTH,
                               SAMPLED_TREE_KINDS, TREE_KINDS)
from vllm_tfm.training import corpus, data
from vllm_tfm.training.acceptance import Drafters, RunStats, simulate
from vllm_tfm.training.dflash import DFlashDrafter
from vllm_tfm.training.loop import fill_family_defaults, setup_device
from vllm_tfm.training.target import Target

REFERENCE_BUDGET = 64
COLORS = {"chain": "tab:gray", "ddtree": "tab:blue", "weaver": "tab:orange"}
LABELS = {"ddtree": "DDTree", "weaver": "DFlash-TfM"}
TREE_DRAWS = ("deterministic", "sampled")


def add_family_arguments(parser: argparse.ArgumentParser) -> None:
    """The models and held-out prompts an acceptance tool reads (also tools/compare_trees.py)."""
    parser.add_argument("--family", choices=("trained", "random"), default="trained",
                        help="tiny family that supplies the paths not given")
    parser.add_argument("--target", help="target model directory")
    parser.add_argument("--dflash", help="DFlash drafter directory")
    parser.add_argument("--weaver", help="Weaver .pth or directory ('none': no weaver rows)")
    parser.add_argument("--prompts", help="JSON list of prompt strings")
    parser.add_argument("--corpus", help="corpus directory (tools/build_corpus.py): held-out "
                        "windows of its held-out packages instead of the stdlib's")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per held-out prompt")
    parser.add_argument("--expand-width", type=int,
                        help="Weaver's nodes expanded per call (default: the engine's, "
                        "ceil(budget / 16)): fewer, wider calls draft faster")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write (PNG beside it)")
    add_family_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--chain-budget", type=int, help="default: the drafter's depth")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--methods", nargs="+", default=list(TREE_KINDS), choices=TREE_KINDS,
                        help="tree kinds to evaluate")
    parser.add_argument("--tree-draws", nargs="+", default=list(TREE_DRAWS), choices=TREE_DRAWS,
                        help="at T>0, deterministic trees verified target-only and/or trees "
                        "with sampled children verified by traversal (DDTree, Weaver)")
    parser.add_argument("--first-exponent", type=float, default=None,
                        help="sampled trees: the first child slot scores max q to this "
                        "power, in (0, 1] (default: the engine's for each kind, "
                        f"{SAMPLED_FIRST_RANK_EXPONENT:g} for Weaver and "
                        f"{DDTREE_SAMPLED_FIRST_RANK_EXPONENT:g} for DDTree)")
    return parser.parse_args(argv)


def prompt_ids(args, tokenizer) -> tuple[list[torch.Tensor], list[str]]:
    if args.prompts:
        texts = json.loads(Path(args.prompts).read_text(encoding="utf-8"))
        if not isinstance(texts, list) or not all(isinstance(t, str) and t for t in texts):
            raise ValueError(
                f"--prompts {args.prompts}: must hold a JSON list of non-empty strings"
            )
        ids = [torch.tensor(tokenizer.encode(t).ids, dtype=torch.int64) for t in texts]
        if any(i.numel() == 0 for i in ids):
            raise ValueError(f"--prompts {args.prompts}: a prompt encodes to no tokens")
        return ids, texts
    if args.corpus:
        windows = data.SourceWindows(tokenizer, texts=corpus.read_split(args.corpus, "heldout"))
        rows = windows.sample(args.num_prompts, args.prompt_len,
                              torch.Generator().manual_seed(args.seed))
    else:
        rows = data.heldout_prompts(tokenizer, args.num_prompts, args.prompt_len, args.seed)
    return list(rows), [tokenizer.decode(row.tolist()) for row in rows]


def summarize(runs: list[RunStats], depth: int) -> dict:
    """tau, acceptance by depth and pool retained mass over the runs of one configuration."""
    accepted = torch.tensor([a for run in runs for a in run.accepted], dtype=torch.float64)
    steps = accepted.numel()
    by_depth = [[] for _ in range(depth)]
    for run in runs:
        for step in run.retained:
            for j, mass in enumerate(step):
                by_depth[j].append(mass)
    flat = torch.tensor([m for masses in by_depth for m in masses], dtype=torch.float64)
    return {
        "tau": (accepted.sum().item() + steps) / steps,
        "steps": steps,
        "tokens": int(accepted.sum().item()) + steps,
        "accept_ge_depth": [(accepted >= d).double().mean().item() for d in range(1, depth + 1)],
        "retained_mass": {
            "mean": flat.mean().item(),
            "p05": flat.quantile(0.05).item(),
            "by_depth_mean": [sum(m) / len(m) if m else None for m in by_depth],
        },
    }


def _ratios(rows: list[dict], budget: int) -> dict:
    """tau per temperature of the chain and of DDTree(budget) and Weaver(budget) with
    deterministic trees, with sampled ones (T>0) and as `verify: "auto"` picks, and the
    Weaver's gains under "auto"."""
    out = {}
    for temperature in sorted({row["temperature"] for row in rows}):
        taus = {
            (row["method"], row["budget"], row["trees"]): row["tau"]
            for row in rows if row["temperature"] == temperature
        }
        chain = next((tau for (method, *_), tau in taus.items() if method == "chain"), None)
        entry, auto = {"chain": chain}, {}
        for method in SAMPLED_TREE_KINDS:
            name = f"{method}{budget}"
            entry[name] = taus.get((method, budget, "deterministic"))
            auto[method] = entry[name]
            if temperature > 0:
                entry[f"{name} sampled"] = taus.get((method, budget, "sampled"))
                auto_samples = temperature >= AUTO_SAMPLED_TREE_MIN_TEMPERATURE[method]
                trees = "sampled" if auto_samples else "deterministic"
                auto[method] = entry[f"{name} auto"] = taus.get((method, budget, trees))
        weaver, ddtree = auto["weaver"], auto["ddtree"]
        if weaver is not None and chain:
            entry[f"weaver{budget}/chain"] = weaver / chain
        if weaver is not None and ddtree:
            entry[f"weaver{budget}/ddtree{budget}"] = weaver / ddtree
        out[f"T={temperature:g}"] = entry
    return out


def plot(rows: list[dict], path: Path, reference: int) -> None:
    """tau vs budget and acceptance by depth at `reference`, one row per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({row["temperature"] for row in rows})
    fig, axes = plt.subplots(len(temperatures), 2, figsize=(11, 4 * len(temperatures)),
                             squeeze=False)
    for (left, right), temperature in zip(axes, temperatures):
        here = [row for row in rows if row["temperature"] == temperature]
        for method, trees in [(m, t) for m in TREE_KINDS for t in TREE_DRAWS]:
            mine = sorted((r for r in here if r["method"] == method and r["trees"] == trees),
                          key=lambda r: r["budget"])
            if not mine:
                continue
            sampled = " sampled" if trees == "sampled" else ""
            style = ":" if sampled else "-"
            if method == "chain":
                left.axhline(mine[0]["tau"], color=COLORS[method], linestyle="--",
                             label=f"chain ({mine[0]['budget']} nodes)")
            else:
                left.plot([r["budget"] for r in mine], [r["tau"] for r in mine], marker="o",
                          color=COLORS[method], linestyle=style,
                          label=LABELS[method] + sampled)
            shown = [r for r in mine if method == "chain" or r["budget"] == reference]
            for r in shown:
                depths = range(1, len(r["accept_ge_depth"]) + 1)
                right.plot(depths, r["accept_ge_depth"], marker=".", color=COLORS[method],
                           linestyle=style, label=f"{method}{sampled} B={r['budget']}")
        left.set_xscale("log", base=2)
        left.set(title=f"T={temperature:g}: mean accepted length", xlabel="budget B",
                 ylabel="tau (tokens / step)")
        right.set(title=f"T={temperature:g}: P(accepted >= d)", xlabel="depth d",
                  ylabel="share of steps")
        left.legend()
        right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def load_drafters(args: argparse.Namespace, with_weaver: bool) -> Drafters:
    """The target, DFlash drafter and (``with_weaver`` and not ``--weaver none``) Weaver of
    ``add_family_arguments``' options, on their device; fills the paths not given."""
    if args.expand_width is not None and not 1 <= args.expand_width <= MAX_EXPAND_WIDTH:
        raise ValueError(f"--expand-width must be in [1, {MAX_EXPAND_WIDTH}], "
                         f"got {args.expand_width}")
    fill_family_defaults(args, trained=args.family == "trained", target="target",
                         dflash="dflash", weaver="weaver")
    if args.weaver == "none":
        args.weaver = None
    device = setup_device(args.device, args.threads)
    target = Target(args.target, device)
    drafter = DFlashDrafter.load(args.dflash, target.hidden_size).to(device).eval()
    target.check_layer_ids(drafter.target_layer_ids)
    weaver = None
    if args.weaver and with_weaver:
        weaver = load_weaver(args.weaver, target_hidden_size=target.hidden_size,
                             target_vocab_size=target.vocab_size, device=device)
        weaver.prepare_tables(target.embed, target.lm_head)
    return Drafters(target, drafter, weaver, expand_width=args.expand_width)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.first_exponent is not None and not 0 < args.first_exponent <= 1:
        raise ValueError(f"--first-exponent must be in (0, 1], got {args.first_exponent}")
    drafters = load_drafters(args, "weaver" in args.methods)
    drafters.first_exponent = args.first_exponent
    methods = [m for m in dict.fromkeys(args.methods) if m != "weaver" or drafters.weaver]
    prompts, texts = prompt_ids(args, data.load_tokenizer(args.target))
    chain_budget = args.chain_budget or drafters.dflash.draft_depth
    configs = [(t, m, b, trees) for t in args.temperatures for m in methods
               for trees in args.tree_draws
               if trees == "deterministic" or (t > 0 and m in SAMPLED_TREE_KINDS)
               for b in ([chain_budget] if m == "chain" else sorted(set(args.budgets)))]
    if not configs:
        raise ValueError(f"--tree-draws {' '.join(args.tree_draws)}: sampled trees exist "
                         "only at --temperatures above 0 and for --methods ddtree / weaver; "
                         "nothing to evaluate")
    reference = REFERENCE_BUDGET if REFERENCE_BUDGET in args.budgets else max(args.budgets)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write_report(rows: list[dict]) -> dict:
        report = {
            "config": {key: value for key, value in vars(args).items()},
            "prompts": texts,
            "summary": _ratios(rows, reference),
            "results": rows,
        }
        out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        plot(rows, out.with_suffix(".png"), reference)
        return report

    rows = []
    bar = tqdm(total=len(configs) * len(prompts), desc="eval acceptance")
    for temperature, method, budget, trees in configs:
        started = time.perf_counter()
        runs = []
        for index, prompt in enumerate(prompts):
            runs.append(simulate(drafters, method, budget, prompt, temperature,
                                 args.max_new_tokens, seed=args.seed + index,
                                 sampled_trees=trees == "sampled"))
            bar.update(1)
        verifier = ("greedy" if temperature == 0 else
                    "traversal" if trees == "sampled" else "target-only")
        row = {"temperature": temperature, "method": method, "budget": budget,
               "trees": trees, "verifier": verifier,
               **summarize(runs, drafters.depth(method, budget)),
               "seconds": time.perf_counter() - started}
        rows.append(row)
        tqdm.write(f"T={temperature:g} {method:6s} B={budget:<4d} {trees:13s} "
                   f"tau={row['tau']:.3f} steps={row['steps']} "
                   f"pool mass={row['retained_mass']['mean']:.4f}")
        report = write_report(rows)  # after every configuration: a cut-short run keeps them
    bar.close()
    print(json.dumps(report["summary"], indent=2))
    return report

if __name__ == "__main__":
    main()
