"""Run a target over prompts and its own continuations; store what drafter training reads.

    python tools/generate_features.py --target <model dir> --dflash <drafter dir> \
        --out work/features [--prompts stdlib|random|FILE.jsonl] [--heldout-prompts FILE]
        [--num-seqs 512] [--heldout-seqs 32] [--prompt-len 32] [--new-tokens 96]
        [--shard-seqs 256] [--batch N] [--device auto|cpu|cuda] [--random-weights]
    torchrun --nproc_per_node 8 tools/generate_features.py ...    (shards split over GPUs)

Each sequence is a prompt window of --prompt-len tokens continued by --new-tokens target
tokens: a --sampled-fraction of training sequences by T=1 sampling, the rest and all
held-out ones greedily (vllm_tfm/training/data.py says why). One more target forward over
the whole sequence gives the layer outputs the drafter reads (`--layer-ids`, default the
--dflash drafter's `target_layer_ids`) and the final-norm states; the format and why it is
all training needs: vllm_tfm/training/features.py.

The target runs through transformers (target.py): fp32 with its PyTorch GDN on a CPU; on
CUDA bf16 with fla's GDN kernels (--dtype, --fla override). --random-weights builds the
--target directory's config with random weights (throughput at a real model's shapes; no
weight files needed).

Resumable: shard i of a split depends on (seed, split, i) alone and is written atomically,
so a killed run, rerun with the same arguments, makes only the missing shards and ends with
the same files. manifest.json holds the spec (a rerun with other arguments is refused,
naming them), then, once every shard exists, the shard list with sha256 and the run's
throughput. Prints one JSON line: tokens, seconds, tokens/s and bytes per million tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from vllm_tfm.training import data, features
from vllm_tfm.training.loop import (
    add_device_args,
    fill_family_defaults,
    seeded_generator,
    setup_runtime,
)
from vllm_tfm.training.target import Target

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    add_device_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def layer_ids_of(args) -> list[int]:
    if args.layer_ids:
        return list(args.layer_ids)
    config = json.loads((Path(args.dflash) / "config.json").read_text(encoding="utf-8"))
    return list(config["dflash_config"]["target_layer_ids"])


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


@torch.no_grad()
def make_shard(target: Target, windows, split: str, index: int, rows: int, args,
               layer_ids, path: Path) -> dict[str, float]:
    """Generate and store one shard; returns its token count and stage seconds."""
    generator = seeded_generator(args.seed, split, index)
    prompts = windows.sample(rows, args.prompt_len, generator)
    sampled = torch.zeros(rows, dtype=torch.bool)
    if split == "train":
        sampled[: round(rows * args.sampled_fraction)] = True
        sampled = sampled[torch.randperm(rows, generator=generator)]
    device_seed = int(torch.randint(0, 2**62, (), generator=generator))
    device_generator = torch.Generator(device=target.device).manual_seed(device_seed)
    started = time.perf_counter()
    tokens = data.continue_prompts(target, prompts, args.new_tokens, sampled, device_generator,
                                   batch_size=args.batch, desc=f"generate {split} {index}")
    generated = time.perf_counter()
    aux, final = target.features(tokens, layer_ids, batch_size=args.batch,
                                 desc=f"features {split} {index}")
    features.write_shard(path, tokens, sampled, aux, final)
    return {"tokens": tokens.numel(), "generate_s": generated - started,
            "forward_s": time.perf_counter() - generated}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    fill_family_defaults(args, target="target", **({} if args.layer_ids else {"dflash": "dflash"}))
    if args.shard_seqs < 1:
        raise ValueError(f"--shard-seqs must be >= 1, got {args.shard_seqs}")
    out = Path(args.out)
    runtime = setup_runtime(args.device, args.threads)
    cuda = runtime.device.type == "cuda"
    args.batch = args.batch or (128 if cuda else 32)
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    dtype = DTYPES[args.dtype or ("bfloat16" if cuda else "float32")]
    use_fla = (args.fla or ("on" if cuda else "off")) == "on"
    digest = data.target_digest(args.target, weights=not args.random_weights)
    spec = feature_spec(args, digest, layer_ids_of(args))
    check_resume(features.read_manifest(out), spec, out)
    target = Target(args.target, runtime.device, dtype, fla=use_fla,
                    random_weights=args.random_weights, seed=args.seed)
    layer_ids = target.check_layer_ids(spec["layer_ids"])
    if runtime.is_main:
        out.mkdir(parents=True, exist_ok=True)
        features.write_manifest(out, {"format": features.FORMAT, "spec": spec,
                                      "complete": False})
        if not (out / features.HEAD_FILE).is_file():
            features.write_head(out, target.embed, target.lm_head)
    runtime.barrier()

    counts = {"train": args.num_seqs, "heldout": args.heldout_seqs}
    jobs = [(split, index, rows) for split in features.SPLITS
            for index, rows in enumerate(shard_rows(counts[split], args.shard_seqs))]
    made = {"tokens": 0.0, "generate_s": 0.0, "forward_s": 0.0}
    windows = {}
    started = time.perf_counter()
    for split, index, rows in jobs[runtime.rank :: runtime.world]:
        path = out / features.shard_name(split, index)
        if path.is_file():
            continue
        if split not in windows:
            windows[split] = data.prompt_windows(spec["prompts"][split], split, args.target,
                                                 target.vocab_size)
        for key, value in make_shard(target, windows[split], split, index, rows, args,
                                     layer_ids, path).items():
            made[key] += value
    seconds = time.perf_counter() - started
    totals = runtime.mean(torch.tensor([made["tokens"], made["generate_s"], made["forward_s"]],
                                       dtype=torch.float64)) * runtime.world
    runtime.barrier()
    if not runtime.is_main:
        return {}
    made = {"tokens": int(totals[0]), "seconds": seconds, "processes": runtime.world,
            "tokens_per_s": float(totals[0]) / seconds if totals[0] else None,
            "generate_s": float(totals[1]), "forward_s": float(totals[2])}
    report = complete_manifest(out, spec, counts, target, layer_ids, made, use_fla)
    print(json.dumps(report))
    return report


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
    }
    features.write_manifest(out, {
        "format": features.FORMAT, "spec": spec, "complete": True, "splits": splits,
        "layer_ids": list(layer_ids), "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size, "report": report,
    })
    return report

if __name__ == "__main__":
    main()
