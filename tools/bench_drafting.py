"""Draft-tree build latency: Weaver best-first, DDTree and chain, per round.

At Qwen3.6-27B Weaver dimensions (d_model 5120, d_embed 5120, d_rank 2048, 1 layer of 16
heads, vocab 248320, pools of 512 over 15 draft positions) with random weights, batch 1 by
default. One round = the engine's `draft_trees`: Weaver's prefix pass + the best-first
expansion loop (about budget / expand_width Weaver calls), or the DDTree / chain
construction from the pools.

    python tools/bench_drafting.py                    # CUDA, prints a table
    python tools/bench_drafting.py --smoke            # tiny dimensions on CPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vllm_tfm.drafting.draft_round import candidate_pools, draft_depth, draft_trees
from vllm_tfm.drafting.weaver import WeaverConfig
from vllm_tfm.drafting.weaver_checkpoint import random_weaver
from vllm_tfm.options import DFLASH_DRAFT_DEPTH, default_expand_width

QWEN36_WEAVER = dict(d_model=5120, d_embed=5120, d_rank=2048, num_layers=1, num_heads=16,
                     mlp_dim=2048 * 4, K=15, candidate_pool_size=512)
QWEN36_VOCAB = 248320
SMOKE_WEAVER = dict(d_model=64, d_embed=64, d_rank=32, num_layers=1, num_heads=2, mlp_dim=64,
                    K=15, candidate_pool_size=64)
SMOKE_VOCAB = 512


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn()`` after two warm-up calls."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny dimensions on CPU")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    device = torch.device("cpu" if args.smoke else "cuda")
    dims, vocab = (SMOKE_WEAVER, SMOKE_VOCAB) if args.smoke else (QWEN36_WEAVER, QWEN36_VOCAB)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    config = WeaverConfig(**dims)
    weaver = random_weaver(config, seed=0).to(device=device, dtype=dtype).eval()
    gen = torch.Generator(device="cpu").manual_seed(0)
    embed = (torch.randn(vocab, config.d_embed, generator=gen) * 0.02).to(device, dtype)
    head = (torch.randn(vocab, config.d_model, generator=gen) * 0.02).to(device, dtype)
    weaver.prepare_tables(embed, head)

    R, D = args.batch, DFLASH_DRAFT_DEPTH
    h_v = torch.randn(R, config.d_model, generator=gen).to(device, dtype)
    hidden = torch.randn(R, D, config.d_model, generator=gen).to(device, dtype)
    logits = torch.randn(R, D, vocab, generator=gen).to(device) * 3
    roots = torch.randint(0, vocab, (R,), generator=gen).to(device)

    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"batch {R}, Weaver {dims}, vocab {vocab}, dtype {dtype}")
    print("| budget | Weaver best-first (ms) | Weaver calls | DDTree (ms) | chain (ms) |")
    print("|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for budget in args.budgets:
            # As in the engine: D = the DFlash block's masks, cut to the budget and K.
            depth = draft_depth(budget, D, weaver)
            pools = candidate_pools(logits[:, :depth], config.candidate_pool_size)

            def round_ms(tree: str) -> float:
                return timed(lambda: draft_trees(tree, roots, pools, budget, weaver=weaver,
                                                 h_v=h_v, dflash_hidden=hidden[:, :depth],
                                                 validate=False), device, args.repeats)

            calls = 1 + -(-budget // default_expand_width(budget))
            weaver_ms, ddtree_ms, chain_ms = (round_ms(t) for t in ("weaver", "ddtree", "chain"))
            print(f"| {budget} | {weaver_ms:.2f} | ~{calls} | {ddtree_ms:.2f} | {chain_ms:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
