"""The CPU demo: the trained tiny model family in vLLM, with and without dflash_tfm.

Loads the committed trained family (models/tiny_trained: a Qwen3-Next-style hybrid
GDN target trained on Python's standard library, its DFlash drafter and Weaver),
generates greedily with no speculation and with ``{"method": "dflash_tfm", ...}``,
and prints both outputs, whether they match (a difference counts as a bf16 tie
only where the target's top-2 margin is small), tokens/s and the mean accepted
length.

    make demo            # or: .venv/bin/python tools/demo.py [--budget 64 --tree weaver]
"""

from __future__ import annotations

import argparse

from vllm_tfm.tiny.engine_runs import PROMPTS, compare_greedy, timed_run
from vllm_tfm.tiny.family import trained_family


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=64, help="tree budget (nodes)")
    parser.add_argument("--tree", choices=["weaver", "ddtree", "chain"], default="weaver")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    from tokenizers import Tokenizer

    family = trained_family()
    tokenizer = Tokenizer.from_file(str(family.target / "tokenizer.json"))
    spec = {"method": "dflash_tfm", "model": str(family.dflash), "tree": args.tree,
            "num_speculative_tokens": args.budget}
    if args.tree == "weaver":
        spec["weaver"] = str(family.weaver)
    prompts = list(PROMPTS[:4])

    print("== no speculation ==", flush=True)
    plain = timed_run(family.target, None, prompts, args.max_tokens, margins=True)
    print(f"== dflash_tfm: {spec} ==", flush=True)
    tree = timed_run(family.target, spec, prompts, args.max_tokens, margins=True)

    rows = compare_greedy(plain, tree)
    for prompt, plain_tokens, tree_tokens, row in zip(prompts, plain["tokens"], tree["tokens"],
                                                      rows):
        print(f"\nprompt: {prompt!r}")
        print(f"  no speculation: {tokenizer.decode(plain_tokens)!r}")
        print(f"  dflash_tfm    : {tokenizer.decode(tree_tokens)!r}")
        if row["matched"] == row["length"]:
            print("  identical")
        else:
            verdict = "a bf16 tie" if row["tie"] else "NOT a tie: a losslessness failure"
            print(f"  first difference at token {row['matched']}, target top-2 margin "
                  f"{row['margin']:.3f} nats ({verdict})")
    print(f"\nno speculation: {plain['tokens_per_s']:.1f} tokens/s")
    print(f"dflash_tfm    : {tree['tokens_per_s']:.1f} tokens/s, mean accepted length "
          f"{tree['tau']:.2f} tokens per target forward")
    print("(a tiny model on 2 CPU cores: plain decoding is cheap here, so the accepted "
          "length, not tokens/s, shows the gain; see BENCHMARKS.md)")


if __name__ == "__main__":
    main()
