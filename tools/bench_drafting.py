"""Draft-round latency: Weaver best-first, DDTree and chain, eager and CUDA-graph replayed.

At Qwen3.6-27B Weaver dimensions (d_model 5120, d_embed 5120, d_rank 2048, 1 layer of 16
heads, mlp_dim from the published parameter count: see ``derive_mlp_dim``), vocab 248320,
pools of 512 over 15 draft positions, bf16, random weights. One round = ``draft_trees``
from the candidate pools: Weaver's prefix pass + the best-first loop (about
budget / expand_width Weaver calls), or the DDTree / chain construction. The pools
themselves (the target LM-head product + top-512, which the chain pays too) are timed
apart. "graph" = ``DraftRound``'s CUDA graph replayed; "eager" = ``draft_trees``.
Before timing, the CUDA run checks the fused kernels against their PyTorch paths and
the graph round against the eager reference builder (``backend="torch"``: the frontier by
stable sorts); it profiles one eager Weaver round (kernel launches by kernel).

    python tools/bench_drafting.py                    # CUDA: checks, then the tables
    python tools/bench_drafting.py --cpu --batches 8 --budgets 64   # the tiny family on CPU
    python tools/bench_drafting.py --cpu --grammar    # structured outputs: cost of a grammar

``--grammar`` (CPU, the trained tiny family's tokenizer) times a JSON-schema grammar inside
the round and the verification: Weaver / DDTree / chain rounds with and without the child
constraint (``vllm_glue.grammar.GrammarConstraint``), then, for the constrained trees, the
scheduler's tree bitmask (``fill_tree_bitmask``), masking the node logits and greedy /
target-only verification with and without the masks.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from triton_ops.testing import rel_err
from triton_ops.weaver_step import node_attention, rms_norm
from vllm_tfm.drafting.draft_round import DraftRound, candidate_pools, draft_depth, draft_trees
from vllm_tfm.drafting.weaver import Weaver, WeaverConfig
from vllm_tfm.drafting.weaver_checkpoint import random_weaver
from vllm_tfm.options import DFLASH_DRAFT_DEPTH, default_expand_width

QWEN36_WEAVER = dict(d_model=5120, d_embed=5120, d_rank=2048, num_layers=1, num_heads=16,
                     K=15, candidate_pool_size=512, layout="rope_swiglu")
QWEN36_PARAMETERS = 56.7e6  # published, rounded to 0.1M
QWEN36_VOCAB = 248320
# The trained tiny family's Weaver (models/tiny_trained/weaver) and target vocabulary.
TINY_WEAVER = dict(d_model=256, d_embed=256, d_rank=128, num_layers=1, num_heads=4, mlp_dim=256,
                   K=15, candidate_pool_size=512, layout="rope_swiglu")
TINY_VOCAB = 1024
TREES = ("weaver", "ddtree", "chain")


def derive_mlp_dim(dims: dict, published: float) -> tuple[int, str]:
    """The mlp_dim whose Weaver has ``published`` parameters (rounded to 0.1M).

    The count is linear in mlp_dim: fixed + per_unit * mlp_dim, both read off the
    module itself (built on the meta device). The 0.1M rounding leaves an interval
    of about 16 widths; exactly one multiple of 16 lies in it.
    """
    def count(mlp_dim: int) -> int:
        with torch.device("meta"):
            weaver = Weaver(WeaverConfig(**dims, mlp_dim=mlp_dim))
        return sum(p.numel() for p in weaver.parameters())

    per_unit = count(2) - count(1)
    fixed = count(1) - per_unit
    low = (published - 0.05e6 - fixed) / per_unit
    high = (published + 0.05e6 - fixed) / per_unit
    fits = [m for m in range(math.ceil(low), math.floor(high) + 1) if m % 16 == 0]
    if len(fits) != 1:
        raise ValueError(f"mlp_dim interval [{low:.1f}, {high:.1f}] holds {fits} multiples of 16")
    note = (f"parameters = {fixed:,} + {per_unit:,} x mlp_dim; {published / 1e6:.1f}M +- 0.05M "
            f"-> mlp_dim in [{low:.1f}, {high:.1f}], whose one multiple of 16 is {fits[0]} "
            f"({count(fits[0]) / 1e6:.3f}M parameters)")
    return fits[0], note


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


def check_kernels(device: torch.device, gen: torch.Generator) -> None:
    """The fused node-step kernels against their PyTorch paths at the bench's shapes."""
    x = torch.randn(16, 5120, generator=gen).to(device, torch.bfloat16)
    weight, bias = (torch.randn(5120, generator=gen).to(device) for _ in range(2))
    fused, plain = (rms_norm(x, weight, bias, 1e-6, backend=b) for b in ("triton", "torch"))
    print(f"check rms_norm [16, 5120] bf16: rel err vs torch {rel_err(fused, plain):.2e}")
    R, w, H, hd, T, M = 4, 8, 16, 128, 16, 130
    q, k, v = (torch.randn(R, w, H, hd, generator=gen).to(device, torch.bfloat16) for _ in range(3))
    pk, pv = (torch.randn(R, T, H, hd, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    caches = [torch.randn(R, M, H, hd, generator=gen).to(device, torch.bfloat16) for _ in range(2)]
    slots = torch.arange(w, device=device).expand(R, w).contiguous() + 100
    ancestors = torch.randint(-1, 90, (R, w, T), generator=gen).to(device)
    angles = torch.rand(T + 1, hd // 2, generator=gen).to(device) * 6
    positions = torch.randint(1, T, (R, w), generator=gen).to(device)
    outs = [node_attention(q, k, v, pk, pv, *[c.clone() for c in caches], slots, ancestors,
                           positions, (angles.cos(), angles.sin()), backend=b)
            for b in ("triton", "torch")]
    print(f"check node_attention [R {R}, w {w}, H {H}, hd {hd}, T {T}] bf16 rotary: rel err vs "
          f"torch {rel_err(outs[0], outs[1]):.2e}")


def profile_round(fn) -> None:
    """Kernel launches of one eager round, by kernel: where a replayed round's time goes."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.count for e in kernels)
    busy = sum(e.device_time_total for e in kernels) / 1e3
    print(f"profile Weaver B 1 budget 64: {total} kernel launches, {busy:.3f} ms of kernel time")
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[:20]:
        print(f"  {e.count:5d} x {e.device_time_total / e.count:8.1f} us  {e.key[:90]}")


def compare_trees(got, want) -> str:
    same = (got.tokens == want.tokens).all(1) & (got.parents == want.parents).all(1) & (
        got.num_nodes == want.num_nodes)
    return (f"{int(same.sum())}/{len(same)} trees identical, max |logq diff| "
            f"{float((got.draft_logq - want.draft_logq).abs().max()):.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true",
                        help="the tiny family's dimensions on CPU in bf16 (as the engine runs)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--eager-repeats", type=int, default=5)
    parser.add_argument("--grammar", action="store_true",
                        help="with --cpu: the cost of a JSON-schema grammar (see above)")
    args = parser.parse_args()
    if args.grammar and not args.cpu:
        parser.error("--grammar runs on CPU with the tiny family's tokenizer: add --cpu")

    device = torch.device("cpu" if args.cpu else "cuda")
    if args.cpu:
        dims, vocab, dtype = TINY_WEAVER, TINY_VOCAB, torch.bfloat16
    else:
        mlp_dim, note = derive_mlp_dim(QWEN36_WEAVER, QWEN36_PARAMETERS)
        print(f"mlp_dim: {note}")
        dims, vocab, dtype = dict(QWEN36_WEAVER, mlp_dim=mlp_dim), QWEN36_VOCAB, torch.bfloat16
    config = WeaverConfig(**dims)
    weaver = random_weaver(config, seed=0).to(device=device, dtype=dtype).eval()
    gen = torch.Generator(device="cpu").manual_seed(0)
    embed = (torch.randn(vocab, config.d_embed, generator=gen) * 0.02).to(device, dtype)
    head = (torch.randn(vocab, config.d_model, generator=gen) * 0.02).to(device, dtype)
    weaver.prepare_tables(embed, head)
    graphs = device.type == "cuda"
    name = torch.cuda.get_device_name() if graphs else "cpu"
    print(f"device: {name}, torch {torch.__version__}, "
          f"Weaver {dims}, vocab {vocab}, dtype {dtype}")
    if graphs:
        try:
            check_kernels(device, gen)
        except Exception as error:
            print(f"kernel checks failed: {error!r}", flush=True)

    if args.grammar:
        grammar_tables(args, weaver, head, gen)
        return
    D = DFLASH_DRAFT_DEPTH
    rows, pool_rows = [], []
    for R in args.batches:
        h_v = torch.randn(R, config.d_model, generator=gen).to(device, dtype)
        hidden = torch.randn(R, D, config.d_model, generator=gen).to(device, dtype)
        roots = torch.randint(0, vocab, (R,), generator=gen).to(device)

        def pools_of(states):
            return candidate_pools((states @ head.T).view(R, D, vocab), config.candidate_pool_size)

        pools_eager = timed(lambda: pools_of(hidden.view(R * D, -1)), device, args.repeats)
        pools_graph = float("nan")
        if graphs:
            static = hidden.view(R * D, -1).clone()
            pools_of(static)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                pools_of(static)
            pools_graph = timed(graph.replay, device, args.repeats)
            del graph
        pool_rows.append(f"| {R} | {pools_eager:.3f} | {pools_graph:.3f} |")
        full_pools = pools_of(hidden.view(R * D, -1))
        for budget in args.budgets:
            depth = draft_depth(budget, D, weaver)  # as in the engine: cut to the budget and K
            pools = type(full_pools)(full_pools.ids[:, :depth].contiguous(),
                                     full_pools.scores[:, :depth].contiguous())
            cells = []
            for tree in TREES:
                inputs = (roots, pools, h_v, hidden[:, :depth])

                def eager():
                    return draft_trees(tree, roots, pools, budget, weaver=weaver, h_v=h_v,
                                       dflash_hidden=hidden[:, :depth], validate=False)

                eager_ms = float("nan")
                try:
                    with torch.inference_mode():
                        repeats = args.eager_repeats if tree == "weaver" else args.repeats
                        eager_ms = timed(eager, device, repeats)
                except Exception as error:  # a failed cell must not lose the table
                    print(f"eager {tree} B {R} budget {budget} failed: {error!r}", flush=True)
                graph_ms = float("nan")
                if graphs:
                    try:
                        round_ = DraftRound(tree, R, depth, pools.ids.shape[2], budget,
                                            device=device, weaver=weaver)
                        got = round_(*inputs)
                        if budget == 64 and R in (1, 8):
                            with torch.no_grad():
                                want = draft_trees(tree, *inputs[:2], budget, weaver=weaver,
                                                   h_v=h_v, dflash_hidden=hidden[:, :depth],
                                                   validate=False, backend="torch")
                            print(f"check graph round = eager reference ({tree}, B {R}, budget "
                                  f"{budget}): {compare_trees(got, want)}", flush=True)
                        graph_ms = timed(round_.graph.replay, device, args.repeats)
                        if tree == "weaver" and budget == 64 and R == 1:
                            with torch.inference_mode():
                                profile_round(eager)
                        if tree == "weaver" and budget == 64:
                            call_ms = timed(lambda: round_(*inputs), device, args.repeats)
                            print(f"Weaver B {R} budget 64: graph call with input copies and "
                                  f"output select {call_ms:.3f} ms (replay {graph_ms:.3f})")
                        del round_
                    except Exception as error:  # a failed cell must not lose the table
                        print(f"graph {tree} B {R} budget {budget} failed: {error!r}", flush=True)
                cells.append(f"{eager_ms:.2f} | {graph_ms:.3f}")
            calls = 1 + -(-budget // default_expand_width(budget))
            rows.append(f"| {R} | {budget} | ~{calls} | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
        if graphs:
            torch.cuda.empty_cache()

    print("\nRound from the pools, median ms (eager = draft_trees, graph = DraftRound replay):")
    print("| B | budget | Weaver calls | Weaver eager | Weaver graph | DDTree eager | "
          "DDTree graph | chain eager | chain graph |")
    print("|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    print("\n".join(rows))
    print("\nPools (LM-head product of the 15 DFlash states + top-512), median ms:")
    print("| B | eager | graph |\n|--:|--:|--:|")
    print("\n".join(pool_rows))


# The JSON schema of the grammar benchmark, and the output each request has reached:
# inside a string value, inside a key, expecting an integer (rows cycle through them).
BENCH_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                                 "size": {"type": "integer"}},
                "required": ["name", "size"]}
BENCH_PREFIXES = ('{"name":"', '{"na', '{"name":"ab","size":')


def bench_grammars(count: int):
    """``count`` vLLM xgrammar grammars of ``BENCH_SCHEMA`` over the trained tiny family's
    tokenizer, each advanced by its ``BENCH_PREFIXES`` output, and their bitmask allocator."""
    import json

    import xgrammar as xgr
    from transformers import AutoTokenizer
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    from vllm_tfm.tiny.family import trained_family

    tokenizer = AutoTokenizer.from_pretrained(trained_family().target)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=TINY_VOCAB)
    # As vLLM compiles it with disable_any_whitespace (compact separators).
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(BENCH_SCHEMA), any_whitespace=False, separators=(",", ":"))
    grammars = []
    for r in range(count):
        grammar = XgrammarGrammar(vocab_size=TINY_VOCAB, matcher=xgr.GrammarMatcher(compiled),
                                  ctx=compiled)
        prefix = tokenizer.encode(BENCH_PREFIXES[r % len(BENCH_PREFIXES)])
        if prefix and not grammar.accept_tokens("", prefix):
            raise ValueError(f"the tokenizer's {prefix} leaves the grammar")
        grammars.append(grammar)
    return grammars, lambda rows: xgr.allocate_token_bitmask(rows, TINY_VOCAB)


def allowed_fraction(trees, grammars) -> float:
    """Drafted nodes whose token the grammar allows below their parent's path."""
    from vllm_tfm.vllm_glue.grammar import _path_tokens

    allowed = total = 0
    tokens, parents = trees.tokens.tolist(), trees.parents.tolist()
    for r, grammar in enumerate(grammars):
        for j in range(1, int(trees.num_nodes[r])):
            path = _path_tokens(tokens[r], parents[r], j)
            allowed += grammar.validate_tokens(path) == path
            total += 1
    return allowed / max(total, 1)


def grammar_tables(args, weaver, head, gen) -> None:
    """Draft rounds and verification with and without a grammar (``--grammar``)."""
    import xgrammar as xgr

    from vllm_tfm.drafting.verifiers import verify_greedy, verify_target_only
    from vllm_tfm.vllm_glue.grammar import GrammarConstraint, fill_state_row, fill_tree_bitmask

    D, config = DFLASH_DRAFT_DEPTH, weaver.config
    round_rows, verify_rows = [], []
    for R in args.batches:
        grammars, allocate = bench_grammars(R)
        h_v = torch.randn(R, config.d_model, generator=gen).to(weaver.dtype)
        hidden = torch.randn(R, D, config.d_model, generator=gen).to(weaver.dtype)
        roots = torch.randint(0, TINY_VOCAB, (R,), generator=gen)
        full = candidate_pools((hidden.view(R * D, -1) @ head.T).view(R, D, TINY_VOCAB),
                               config.candidate_pool_size)
        for budget in args.budgets:
            depth = draft_depth(budget, D, weaver)
            pools = type(full)(full.ids[:, :depth].contiguous(), full.scores[:, :depth].contiguous())
            for tree in TREES:
                def round_(constraint):
                    return draft_trees(tree, roots, pools, budget, weaver=weaver, h_v=h_v,
                                       dflash_hidden=hidden[:, :depth], validate=False,
                                       constraint=constraint)

                constraint = GrammarConstraint(grammars, allocate)
                repeats = args.eager_repeats if tree == "weaver" else args.repeats
                with torch.inference_mode():
                    plain_ms = timed(lambda: round_(None), weaver.device, repeats)
                    constrained_ms = timed(lambda: round_(constraint), weaver.device, repeats)
                    plain, constrained = round_(None), round_(constraint)
                nodes = int(constrained.num_nodes.sum()) - R
                round_rows.append(
                    f"| {tree} | {R} | {budget} | {plain_ms:.2f} | {constrained_ms:.2f} | "
                    f"{allowed_fraction(plain, grammars):.0%} | "
                    f"{allowed_fraction(constrained, grammars):.0%} | {nodes / R:.1f} |")
                print(round_rows[-1], flush=True)
                if tree != "weaver":
                    continue
                # Verification of the constrained trees, as the engine runs it.
                N = constrained.tokens.shape[1]
                logits = torch.randn(R, N, TINY_VOCAB, generator=gen)
                seeds = torch.arange(R, dtype=torch.int64)
                tokens, parents = constrained.tokens.tolist(), constrained.parents.tolist()

                def tree_bitmask():
                    rows = allocate(R * N)
                    for r, grammar in enumerate(grammars):
                        n = int(constrained.num_nodes[r])
                        fill_state_row(grammar, rows, r * N)
                        fill_tree_bitmask(grammar, tokens[r][1:n], parents[r][1:n], rows, r * N)
                    return rows

                rows = tree_bitmask()

                def masked_logits():
                    out = logits.view(R * N, -1).clone()
                    xgr.apply_token_bitmask_inplace(out, rows)
                    return out.view(R, N, -1)

                masked = masked_logits()
                fill_ms = timed(tree_bitmask, weaver.device, args.repeats)
                apply_ms = timed(masked_logits, weaver.device, args.repeats)
                cells = []
                for target in (logits, masked):
                    probs = torch.softmax(target, -1)
                    cells.append(timed(lambda: verify_greedy(constrained, target, validate=False),
                                       weaver.device, args.repeats))
                    cells.append(timed(lambda: verify_target_only(constrained, probs, seeds,
                                                                  validate=False),
                                       weaver.device, args.repeats))
                verify_rows.append(
                    f"| {R} | {budget} | {nodes / R:.1f} | {fill_ms:.2f} | {apply_ms:.3f} | "
                    + " | ".join(f"{c:.3f}" for c in cells) + " |")
                print(verify_rows[-1], flush=True)
    print("\nDraft round from the pools with a JSON-schema grammar, median ms (eager "
          "draft_trees; allowed = drafted nodes the grammar allows below their parent):")
    print("| tree | B | budget | no grammar | grammar constraint | allowed, no grammar | "
          "allowed, constraint | nodes per tree |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    print("\n".join(round_rows))
    print("\nVerification of the constrained Weaver trees, median ms: the scheduler's tree "
          "bitmask, masking the node logits (xgrammar), greedy / target-only verifiers on "
          "unmasked and masked logits:")
    print("| B | budget | nodes per tree | tree bitmask | mask logits | greedy | target-only | "
          "greedy, masked | target-only, masked |")
    print("|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    print("\n".join(verify_rows))


if __name__ == "__main__":
    main()
