"""Tree builders compared on the same contexts, by the verifier's exact expected accepted length.

    python tools/compare_trees.py --out artifacts/eval/paired_t1.json --temperature 1 \
        --specs ddtree:64:sampled weaver:64:sampled weaver:64:sampled:1 [--num-prompts 16]

``eval_acceptance`` decodes one stream per configuration: each draws its own verifier coins
and, past the first divergence, sees other contexts, so two configurations a few per cent
apart need hundreds of prompts to be told apart. Here every configuration drafts at the
SAME contexts: each position of a continuation the target itself generated (sampled at the
temperature, greedy at 0; one token at a time, so every position is a context), from the
same pools and, for trees with sampled children, the same tree seeds. Its tree's target
rows are computed exactly (``Target.score_paths``), and the accepted length is the exact
expectation over the verifier's coins of the law the engine's verifier follows
(``traversal_plan`` for sampled trees, ``target_only_plan`` for deterministic ones at T > 0,
the greedy walk at T = 0), averaged over ``--tree-samples`` tree seeds per context.

The per-position tau reported (1 + mean expected accepted tokens over contexts) weights
every position alike, where a decoding run's tau weights the positions its steps start
at; the two differ a little. What this tool is for is the paired difference: each spec
against the first, per prompt, with its standard error over prompts (positions of one
prompt are correlated, prompts are not).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from vllm_tfm.drafting.builders import sampled_first_exponent
from vllm_tfm.drafting.tree import DraftTree, derive_seeds
from vllm_tfm.drafting.verifiers import target_only_plan, traversal_plan, verify_greedy
from vllm_tfm.options import SAMPLED_TREE_KINDS, TREE_KINDS
from vllm_tfm.training import data
from vllm_tfm.training.acceptance import Drafters, tree_logits
from vllm_tfm.training.eval_acceptance import add_family_arguments, load_drafters, prompt_ids
from vllm_tfm.training.target import DecodeSession


@dataclass(frozen=True)
class TreeSpec:
    """One configuration: ``KIND:BUDGET[:sampled[:FIRST_EXPONENT]]``, e.g. ``chain:15``,
    ``ddtree:64``, ``weaver:64:sampled:0.5`` (the exponent: sampled trees only)."""

    tree: str
    budget: int
    sampled: bool = False
    first_exponent: float | None = None  # None: the kind's own

    @classmethod
    def parse(cls, text: str) -> TreeSpec:
        fields = text.split(":")
        form = "KIND:BUDGET[:sampled[:FIRST_EXPONENT]]"
        if not 2 <= len(fields) <= 4 or fields[0] not in TREE_KINDS:
            raise ValueError(f"spec {text!r}: expected {form} with KIND in {list(TREE_KINDS)}")
        try:
            budget = int(fields[1])
            exponent = float(fields[3]) if len(fields) == 4 else None
        except ValueError:
            raise ValueError(f"spec {text!r}: BUDGET must be an int and FIRST_EXPONENT a "
                             f"number ({form})") from None
        sampled = len(fields) >= 3
        if sampled and (fields[2] != "sampled" or fields[0] not in SAMPLED_TREE_KINDS):
            raise ValueError(f"spec {text!r}: the third field can only be 'sampled', for "
                             f"kinds {list(SAMPLED_TREE_KINDS)}")
        if exponent is not None and not 0 < exponent <= 1:
            raise ValueError(f"spec {text!r}: FIRST_EXPONENT must be in (0, 1]")
        if budget < 1:
            raise ValueError(f"spec {text!r}: BUDGET must be >= 1")
        return cls(fields[0], budget, sampled, exponent)

    @property
    def label(self) -> str:
        text = f"{self.tree}:{self.budget}"
        if self.sampled:
            text += f":sampled:{sampled_first_exponent(self.tree, self.first_exponent):g}"
        return text


@torch.no_grad()
def prompt_contexts(drafters: Drafters, specs: list[TreeSpec], prompt: torch.Tensor,
                    temperature: float, positions: int, tree_samples: int,
                    seed: int) -> torch.Tensor:
    """[len(specs), positions] expected accepted drafted tokens of each spec at each of the
    first ``positions`` positions after ``prompt`` of the target's own continuation."""
    target = drafters.target
    device = target.device
    session = target.session(drafters.dflash.target_layer_ids)
    out = session.extend(prompt.to(device)[None])
    aux, h_v = out.aux, out.final[:, -1]
    generator = torch.Generator(device=device).manual_seed(seed)

    def next_token(logits: torch.Tensor) -> torch.Tensor:
        if temperature == 0:
            return logits.argmax()
        return torch.multinomial(torch.softmax(logits / temperature, -1), 1,
                                 generator=generator)[0]

    root = next_token(out.logits[0, -1])
    seeds = torch.tensor([seed], device=device)
    by_spec = [replace(drafters, first_exponent=spec.first_exponent) for spec in specs]
    table = torch.zeros(len(specs), positions, dtype=torch.float64)
    for position in range(positions):
        anchor = torch.tensor([session.length], device=device)
        for index, (spec, spec_drafters) in enumerate(zip(specs, by_spec)):
            draws = tree_samples if spec.sampled else 1
            for draw in range(draws):
                tree_seeds = None
                if spec.sampled:
                    tree_seeds = derive_seeds(seeds, position * tree_samples + draw)
                drafted, _ = spec_drafters.propose(spec.tree, spec.budget, root.view(1), aux,
                                                   anchor, h_v, tree_seeds)
                table[index, position] += _expected(drafted, session, temperature) / draws
        out = session.extend(root.view(1, 1))
        aux = torch.cat([aux, out.aux], 1)
        h_v = out.final[:, -1]
        root = next_token(out.logits[0, -1])
    return table


def _expected(drafted: DraftTree, session: DecodeSession, temperature: float) -> float:
    """The exact expected accepted length of one request's tree under its verifier."""
    logits = tree_logits(session, drafted)
    if temperature == 0:
        return float(verify_greedy(drafted, logits[None]).accepted_len[0])
    probs = torch.softmax(logits.double() / temperature, -1)[None]
    plan = traversal_plan(drafted, probs) if drafted.sampled else target_only_plan(drafted, probs)
    return float(plan.expected_accepted(drafted.max_depth)[0])


def summarize(specs: list[TreeSpec], tables: list[torch.Tensor]) -> list[dict]:
    """Per spec: per-position tau, and against the first spec the ratio of taus and the
    paired difference of per-prompt means with its standard error over prompts."""
    per_prompt = torch.stack([table.mean(1) for table in tables], 1)  # [specs, prompts]
    taus = 1 + per_prompt.mean(1)
    rows = []
    for index, spec in enumerate(specs):
        difference = per_prompt[index] - per_prompt[0]
        count = difference.numel()
        error = difference.std().item() / math.sqrt(count) if count > 1 else float("nan")
        rows.append({"spec": spec.label, "tau_per_position": taus[index].item(),
                     "ratio_to_first": (taus[index] / taus[0]).item(),
                     "difference_to_first": difference.mean().item(),
                     "difference_stderr": error})
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--specs", nargs="+", required=True,
                        help="KIND:BUDGET[:sampled[:FIRST_EXPONENT]] each; the first is the "
                        "reference the others are paired against")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--positions", type=int, default=48,
                        help="contexts per prompt: the first positions of its continuation")
    parser.add_argument("--tree-samples", type=int, default=2,
                        help="tree seeds per context for trees with sampled children")
    add_family_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    specs = [TreeSpec.parse(text) for text in args.specs]
    if args.temperature < 0 or (args.temperature == 0 and any(s.sampled for s in specs)):
        raise ValueError("--temperature must be >= 0, and above 0 for sampled specs; got "
                         f"{args.temperature}")
    if args.positions < 1 or args.tree_samples < 1:
        raise ValueError(f"--positions and --tree-samples must be >= 1, got {args.positions} "
                         f"and {args.tree_samples}")
    drafters = load_drafters(args, any(s.tree == "weaver" for s in specs))
    if drafters.weaver is None and any(s.tree == "weaver" for s in specs):
        raise ValueError("weaver specs need a Weaver (--weaver is 'none')")
    for spec in specs:
        drafters.check(spec.tree, spec.budget)
    prompts, texts = prompt_ids(args, data.load_tokenizer(args.target))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tables = []
    for index, prompt in enumerate(prompts):
        tables.append(prompt_contexts(drafters, specs, prompt, args.temperature, args.positions,
                                      args.tree_samples, seed=args.seed + index))
        rows = summarize(specs, tables)
        report = {"config": vars(args), "prompts": texts[: len(tables)], "summary": rows,
                  "expected_accepted": [table.tolist() for table in tables]}
        out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"prompt {index + 1}/{len(prompts)}: " + "  ".join(
            f"{row['spec']} {row['tau_per_position']:.3f}" for row in rows), flush=True)
    for row in rows:
        print(f"{row['spec']:28s} tau/position {row['tau_per_position']:.3f}  "
              f"x first {row['ratio_to_first']:.4f}  "
              f"diff {row['difference_to_first']:+.4f} +- {row['difference_stderr']:.4f}")
    return rows
