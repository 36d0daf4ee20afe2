"""Train the tiny family end to end: target, features, DFlash drafter, Weaver; a manifest.

    python tools/train_family.py --out models/tiny_trained [--stages target features \
        dflash weaver manifest] [--work artifacts/train_family] [--base DIR] [--device auto]

The recipe of the committed family (models/tiny_trained, see its README). Each stage runs
one training tool with the recipe's arguments (`recipe`), resumable through the tool's
checkpoint in --work:

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
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import platform
import shlex
from pathlib import Path

import torch

from vllm_tfm.tiny import family as tiny_family
from vllm_tfm.training import data
from vllm_tfm.training.loop import is_main_process

STAGES = ("target", "features", "dflash", "weaver", "manifest")


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
    return parser.parse_args(argv)


def recipe(out: Path, work: Path, base: Path, device: str, smoke: bool) -> dict[str, list[str]]:
    """Each stage's command-line arguments."""
    def size(full: int, small: int) -> str:
        return str(small if smoke else full)

    features = str(work / "features")
    return {
        "target": [
            "--config", str(base / "target"), "--out", str(out / "target"),
            "--checkpoint", str(work / "target.ckpt"), "--steps", size(900, 2),
            "--batch", size(64, 2), "--seq-len", size(256, 32), "--eval-batches", size(4, 1),
            "--eval-every", "500", "--save-every", "500", "--device", device,
        ],
        "features": [
            "--target", str(out / "target"), "--dflash", str(base / "dflash"),
            "--out", features, "--num-seqs", size(8192, 8), "--heldout-seqs", size(64, 4),
            "--prompt-len", size(32, 8), "--new-tokens", size(96, 20),
            "--shard-seqs", size(1024, 4), "--batch", size(1024, 4), "--device", device,
        ],
        "dflash": [
            "--features", features, "--init", str(base / "dflash"),
            "--out", str(out / "dflash"), "--checkpoint", str(work / "dflash.ckpt"),
            "--steps", size(6000, 2), "--lr", "2e-3", "--batch", size(64, 2),
            "--eval-every", "1000", "--save-every", "1000", "--device", device,
        ],
        "weaver": [
            "--features", features, "--dflash", str(out / "dflash"),
            "--out", str(out / "weaver"), "--public-out", str(work / "weaver.pth"),
            "--checkpoint", str(work / "weaver.ckpt"),
            "--steps", size(2000, 2), "--batch", size(64, 2), "--eval-budget", size(64, 8),
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


def write_manifest(out: Path, stages: dict[str, list[str]], results: dict) -> dict:
    import transformers

    manifest = {
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
        "data": data_split(),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.base is None:
        args.base = str(tiny_family.build_family().root)
    out, work, base = Path(args.out), Path(args.work), Path(args.base)
    stages = recipe(out, work, base, args.device, args.smoke)
    results_path = work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    for name in args.stages:
        if name == "manifest":
            return write_manifest(out, stages, results) if is_main_process() else {}
        tool = importlib.import_module(f"vllm_tfm.training.{stage_module(name)}")
        summary = tool.main(stages[name])
        results[name] = {k: v for k, v in summary.items() if k not in ("out", "public_out")}
        if is_main_process():
            work.mkdir(parents=True, exist_ok=True)
            results_path.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return results


if __name__ == "__main__":
    main()
