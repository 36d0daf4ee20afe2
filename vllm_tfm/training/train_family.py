"""Train a tiny family end to end: target, features, DFlash drafter, Weaver; a manifest.

    python tools/train_family.py --out models/tiny_trained [--stages target features \
        dflash weaver manifest] [--work artifacts/train_family] [--base DIR] [--device auto]
    python tools/train_family.py --recipe sharp --corpus artifacts/sharp_corpus \
        --out artifacts/tiny_sharp --device cuda

Two recipes (`--recipe`): "tiny", the committed family's (models/tiny_trained, see its
README), on the standard library; "sharp", a larger target on a site-packages corpus
(`SHARP_*`, below). Each stage runs one training tool with the recipe's arguments (`recipe`),
resumable through the tool's checkpoint in --work:

  target   tools/train_target.py: the tiny family's Qwen3-Next config and tokenizer (from
           --base/target), fresh initialisation, next-token loss on the standard library's
           training modules.
  features tools/generate_features.py: the trained target's continuations of standard-
           library prompts and its features (the drafter's layers), in --work/features.
  dflash   tools/train_dflash.py on those features, starting from --base/dflash (the
           family's drafter config).
  weaver   tools/train_weaver.py on the same features and the trained drafter.
  manifest out/manifest.json: sha256 of every file, the recipe, the software, the data split.

--base defaults to the tiny family built on this machine (vllm_tfm/tiny/family.py); give a
copy of it when the machine's standard library differs from the one it was built from (the
tokenizer is trained on standard-library files). `--smoke` shrinks every stage to a few
steps (a test of the pipeline, not a model). Under torchrun every stage runs on all
processes (vllm_tfm/training/loop.py). The recipe takes about 14 minutes on one H200;
the data are the machine's own standard library, so a different Python gives a different
(equally valid) family.

The sharp recipe reads a corpus built by tools/build_corpus.py (vllm_tfm/training/corpus.py:
the sources of the project's own site-packages, split by package, with a tokenizer trained
on the training packages) and carried to the GPU machine with its manifest; its --base is
written from `SHARP_TARGET`, `SHARP_DFLASH` and that corpus's tokenizer into --work/base.
Sizes: target Qwen3-Next-style, 8 layers (GDN x3 + attention) x 2, hidden 384, layers 3
and 7 MoE with 4 experts (top 2) and a shared expert (tensor parallelism up to 4 ranks can
split them), the others dense: 12.4M parameters (24.9 MB bf16) at a 2048-token vocabulary. It reads
800 steps x 256 windows x 256 tokens = 52.4M tokens, random windows of the ~94M tokens of
the training packages (271 MB at 2.88 bytes a token): about half an epoch, so it cannot
overfit (the held-out packages' loss is in the results). Drafter: 2 Qwen3 layers, hidden
384 (3.6M, 7.2 MB), 3000 steps; Weaver: d_rank 192, 4 heads, MLP 384 (~0.6M, 2.4 MB fp32),
1500 steps; both on 8192 target continuations. The target runs transformers' PyTorch GDN
everywhere (`--fla off`): the GPU image has no fla, and at these sizes its kernels would
buy little. Expected on one H200: ~8 minutes (an estimate scaled from the tiny recipe's
2026-11-29 stage times, not measured).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import platform
import shlex
import sys
from pathlib import Path

import torch

from vllm_tfm.tiny import family as tiny_family
from vllm_tfm.training import corpus, data
from vllm_tfm.training.loop import is_main_process

STAGES = ("target", "features", "dflash", "weaver", "manifest")
RECIPES = ("tiny", "sharp")

# The sharp family's architecture: the tiny family's configs with these changes (the
# vocabulary comes from the corpus's tokenizer).
SHARP_LAYERS = 8
SHARP_TARGET = {
    "hidden_size": 384,
    "intermediate_size": 640,
    "num_hidden_layers": SHARP_LAYERS,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
    "mlp_only_layers": [i for i in range(SHARP_LAYERS) if i % 4 != 3],
    # transformers' per-expert loop, the path the CPU tests run: its default on CUDA,
    # torch._grouped_mm, is untested here under bf16 autocast over fp32 weights.
    "experts_implementation": "eager",
}
SHARP_DFLASH = {
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "num_target_layers": SHARP_LAYERS,
}
SHARP_WEAVER = ["--d-rank", "192", "--num-heads", "4", "--mlp-dim", "384"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="family directory to write")
    parser.add_argument("--work", default="artifacts/train_family",
                        help="checkpoints and the features")
    parser.add_argument("--base", help="tiny family directory with target/ and dflash/ "
                        "(default: built by vllm_tfm/tiny/family.py)")
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--smoke", action="store_true", help="a few steps per stage")
    parser.add_argument("--recipe", default="tiny", choices=RECIPES)
    parser.add_argument("--corpus", help="corpus directory (tools/build_corpus.py); the "
                        "sharp recipe's data")
    args = parser.parse_args(argv)
    if (args.recipe == "sharp") != (args.corpus is not None):
        raise ValueError("--corpus is needed by --recipe sharp and only by it, got "
                         f"--recipe {args.recipe} with --corpus {args.corpus}")
    if args.recipe == "sharp" and args.base is not None:
        raise ValueError("--recipe sharp writes its own base (from SHARP_* and the corpus): "
                         "drop --base")
    return args


def build_sharp_base(corpus_dir: Path, base: Path) -> Path:
    """The sharp family's configs (`SHARP_*` over the tiny family's) with the corpus's
    tokenizer: base/target (config + tokenizer files) and base/dflash (config.json)."""
    vocab = corpus.read_manifest(corpus_dir)["tokenizer"]["vocab_size"]
    target = {**tiny_family.TARGET_CONFIG, **SHARP_TARGET, "vocab_size": vocab}
    drafter = {**tiny_family.DFLASH_CONFIG, **SHARP_DFLASH, "vocab_size": vocab}
    files = {"target/config.json": json.dumps(target, indent=2) + "\n",
             "dflash/config.json": json.dumps(drafter, indent=2) + "\n"}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        files[f"target/{name}"] = (corpus_dir / name).read_text(encoding="utf-8")
    # Written by every process of a torchrun: each file appears whole, by a rename.
    for name, text in files.items():
        path = base / name
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{os.getpid()}")
        staging.write_text(text, encoding="utf-8")
        os.replace(staging, path)
    return base


def recipe(out: Path, work: Path, base: Path, device: str, smoke: bool,
           corpus_dir: Path | None = None) -> dict[str, list[str]]:
    """Each stage's command-line arguments: the tiny recipe, or (`corpus_dir` given) the
    sharp one, whose sizes are the second of each `size` pair and which adds its text
    source, learning rate, transformers' PyTorch GDN and the Weaver's dimensions."""
    sharp = corpus_dir is not None

    def size(tiny: int, sharp_full: int, small: int) -> str:
        return str(small if smoke else sharp_full if sharp else tiny)

    text = ["--text", f"{corpus.SOURCE_PREFIX}{corpus_dir}", "--lr", "2e-3"] if sharp else []
    prompts = ["--prompts", f"{corpus.SOURCE_PREFIX}{corpus_dir}"] if sharp else []
    features = str(work / "features")
    return {
        "target": [
            "--config", str(base / "target"), *text, "--out", str(out / "target"),
            "--checkpoint", str(work / "target.ckpt"), "--steps", size(900, 800, 2),
            "--batch", size(64, 256, 2), "--seq-len", size(256, 256, 32),
            "--eval-batches", size(4, 4, 1),
            "--eval-every", "500", "--save-every", "500", "--device", device,
        ],
        "features": [
            "--target", str(out / "target"), "--dflash", str(base / "dflash"), *prompts,
            # Stages share one process, whose target stage hid fla (and the GPU image has none).
            "--fla", "off", "--out", features, "--num-seqs", size(8192, 8192, 8),
            "--heldout-seqs", size(64, 64, 4), "--prompt-len", size(32, 32, 8),
            "--new-tokens", size(96, 96, 20), "--shard-seqs", size(1024, 1024, 4),
            "--batch", size(1024, 1024, 4), "--device", device,
        ],
        "dflash": [
            "--features", features, "--init", str(base / "dflash"),
            "--out", str(out / "dflash"), "--checkpoint", str(work / "dflash.ckpt"),
            "--steps", size(6000, 3000, 2), "--lr", "2e-3", "--batch", size(64, 64, 2),
            "--eval-every", "1000", "--save-every", "1000", "--device", device,
        ],
        "weaver": [
            "--features", features, "--dflash", str(out / "dflash"),
            "--out", str(out / "weaver"), "--public-out", str(work / "weaver.pth"),
            "--checkpoint", str(work / "weaver.ckpt"), *(SHARP_WEAVER if sharp else []),
            "--steps", size(2000, 1500, 2), "--batch", size(64, 64, 2),
            "--eval-budget", size(64, 64, 8),
            "--eval-every", "1000", "--save-every", "500", "--device", device,
        ],
    }


def stage_module(stage: str) -> str:
    return "generate_features" if stage == "features" else f"train_{stage}"


def data_split() -> dict:
    """The standard-library split the family was trained and evaluated on."""
    train = data.stdlib_sources("train")
    root = data.stdlib_root()
    listing = "\n".join(str(p.relative_to(root)) for p in train).encode()
    return {
        "stdlib": str(root),
        "heldout_modules": list(data.HELDOUT_MODULES),
        "train_files": len(train),
        "train_bytes": sum(p.stat().st_size for p in train),
        "train_file_list_sha256": hashlib.sha256(listing).hexdigest(),
    }


def corpus_split(corpus_dir: Path) -> dict:
    """What the sharp family was trained and evaluated on: the corpus manifest's splits,
    held-out packages (each with its files' sha256 digest) and that manifest's sha256 (the
    manifest itself, with every held-out file's sha256, is copied as corpus.json)."""
    manifest = corpus.read_manifest(corpus_dir)
    return {
        "corpus": str(corpus_dir),
        "corpus_manifest_sha256": hashlib.sha256(
            (corpus_dir / corpus.MANIFEST).read_bytes()).hexdigest(),
        "root": manifest["root"],
        "splits": manifest["splits"],
        "heldout_packages": {name: manifest["packages"][name]
                             for name in manifest["heldout_packages"]},
        "train_packages": sum(p["split"] == "train" for p in manifest["packages"].values()),
        "tokenizer": manifest["tokenizer"],
    }


def write_manifest(out: Path, stages: dict[str, list[str]], results: dict,
                   corpus_dir: Path | None = None, command: list[str] | None = None) -> dict:
    import shutil

    import transformers

    if corpus_dir is not None:
        shutil.copyfile(corpus_dir / corpus.MANIFEST, out / "corpus.json")
    manifest = {
        "command": shlex.join(["python", "tools/train_family.py", *(command or [])]),
        "files": tiny_family.file_digests(out),
        "recipe": {name: shlex.join(["python", f"tools/{stage_module(name)}.py", *args])
                   for name, args in stages.items()},
        "results": results,
        "software": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        },
        "data": data_split() if corpus_dir is None else corpus_split(corpus_dir),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out, work = Path(args.out), Path(args.work)
    corpus_dir = args.corpus and Path(args.corpus)
    if corpus_dir is not None:
        base = build_sharp_base(corpus_dir, work / "base")
    else:
        base = Path(args.base or tiny_family.build_family().root)
    stages = recipe(out, work, base, args.device, args.smoke, corpus_dir)
    results_path = work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    for name in args.stages:
        if name == "manifest":
            if not is_main_process():
                return {}
            return write_manifest(out, stages, results, corpus_dir,
                                  sys.argv[1:] if argv is None else argv)
        tool = importlib.import_module(f"vllm_tfm.training.{stage_module(name)}")
        summary = tool.main(stages[name])
        results[name] = {k: v for k, v in summary.items() if k not in ("out", "public_out")}
        if is_main_process():
            work.mkdir(parents=True, exist_ok=True)
            results_path.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return results


if __name__ == "__main__":
    main()
