"""Throughput of the training path at a real target's shapes: feature generation, then
DFlash and Weaver training from the features, with random weights.

    python tools/bench_training.py --shapes qwen3.6-27b --device cuda --work /tmp/bench
    python tools/bench_training.py --shapes tiny --device cpu --work /tmp/bench   (smoke)
    python tools/bench_training.py --engine vllm --features-only ...   (vLLM decoding; GPU
        harness tools/gpu_vllm on CUDA)

qwen3.6-27b: the target is Qwen3.6-27B's text model (64 layers, hidden 5120, GDN x3 + full
attention, vocabulary 248320; `QWEN36_27B_TARGET`) with random bf16 weights and fla's GDN
kernels; the DFlash drafter has the published shape (5 layers, hidden 5120, target layers
1, 16, 31, 46, 61; attention and MLP widths as the target's Qwen3 layers would have, our
assumption); the Weaver the published dimensions (d_rank 2048, 1 layer, 16 heads, SwiGLU,
mlp_dim 1376 as in DESIGN.md section 3's stand-in). tiny: the tiny family (CPU smoke).

Stages (each a command of vllm_tfm/training, in-process, in --work): generate_features
over random prompts (continuations decoded by --engine), train_dflash, train_weaver
(--features-only: the first stage only). Prints one table: feature tokens/s (whole run, and
decoding's own: generated tokens / generate seconds) and bytes per million tokens; per training command the seconds per step (median after the
first), trained tokens/s (blocks x 15 positions per step), peak GPU memory, and the hours
one epoch over --epoch-tokens stored tokens would take (an epoch: every stored sequence
read once, --anchors blocks from each). The numbers also go to <work>/report.json.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from vllm_tfm.training import generate_features, train_dflash, train_weaver
from vllm_tfm.training.loop import add_device_args, sibling

QWEN36_27B_TARGET = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "full_attention_interval": 4,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    # As the published Qwen3.5/3.6 configs: vLLM then keeps the GDN states in fp32 (without
    # it, bf16: stop 19's engine runs, whose state pages were half as large).
    "mamba_ssm_dtype": "float32",
}
QWEN36_27B_DFLASH = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "vocab_size": 248320,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000000.0,
    "block_size": 16,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
}
QWEN36_WEAVER_ARGS = ["--d-rank", "2048", "--num-heads", "16", "--mlp-dim", "1376",
                      "--layout", "rope_swiglu"]
SHAPES = ("qwen3.6-27b", "tiny")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=SHAPES, default="qwen3.6-27b")
    parser.add_argument("--work", required=True, help="directory for models and features")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--heldout-seqs", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--feature-batch", type=int, help="generate_features --batch")
    parser.add_argument("--engine", choices=generate_features.ENGINES, default="transformers",
                        help="generate_features --engine")
    parser.add_argument("--features-only", action="store_true",
                        help="stop after feature generation (no training stages)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per command")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--anchors", type=int, default=4)
    parser.add_argument("--epoch-tokens", type=float, default=1e9)
    add_device_args(parser)
    return parser.parse_args(argv)


def build_models(shapes: str, work: Path) -> tuple[list[str], Path, list[str]]:
    """generate_features' target options, the DFlash drafter directory and the Weaver
    shape options."""
    if shapes == "tiny":
        from vllm_tfm.tiny import family as tiny_family

        family = tiny_family.build_family()
        return ["--target", str(family.target)], family.dflash, []
    target_dir, dflash_dir = work / "target", work / "dflash_random"
    target_dir.mkdir(parents=True, exist_ok=True)
    (target_dir / "config.json").write_text(json.dumps(QWEN36_27B_TARGET, indent=1))
    # A config alone: generate_features reads its target_layer_ids, train_dflash starts
    # from a random initialisation of it.
    dflash_dir.mkdir(parents=True, exist_ok=True)
    (dflash_dir / "config.json").write_text(json.dumps(QWEN36_27B_DFLASH, indent=1))
    return ["--target", str(target_dir), "--random-weights"], dflash_dir, QWEN36_WEAVER_ARGS


def timed_training(main, argv: list[str], device: str, trained_tokens: int,
                   steps_per_epoch: float) -> dict:
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    gc.collect()  # the feature stage's target (hooks make it a reference cycle)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    summary = main(argv)
    per_step = summary["seconds_per_step"]
    return {
        "seconds_per_step": per_step,
        "trained_tokens_per_s": trained_tokens / per_step,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "epoch_hours": steps_per_epoch * per_step / 3600,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    work = Path(args.work)
    target_args, dflash_dir, weaver_args = build_models(args.shapes, work)
    features_dir = work / "features"
    device = ["--device", args.device, "--threads", str(args.threads)]
    feature_report = generate_features.main([
        *target_args, "--dflash", str(dflash_dir), "--out", str(features_dir),
        "--prompts", "random", "--num-seqs", str(args.num_seqs),
        "--heldout-seqs", str(args.heldout_seqs), "--prompt-len", str(args.prompt_len),
        "--new-tokens", str(args.new_tokens), "--shard-seqs", str(max(1, args.num_seqs // 4)),
        "--engine", args.engine,
        *(["--batch", str(args.feature_batch)] if args.feature_batch else []), *device,
    ])
    made = feature_report["this_run"]
    decoded = made["generated_seqs"] * args.new_tokens
    print(f"features ({args.engine}): {made['tokens_per_s'] or float('nan'):.0f} tokens/s "
          f"({made['tokens']} tokens in {made['seconds']:.1f} s: engine start "
          f"{made['engine_start_s']:.1f} s, generate {made['generate_s']:.1f} s = "
          f"{decoded / max(made['generate_s'], 1e-9):.0f} decoded tokens/s, forward "
          f"{made['forward_s']:.1f} s), {feature_report['bytes_per_million_tokens'] / 1e9:.2f}"
          " GB per million tokens", flush=True)
    report = {"shapes": args.shapes, "engine": args.engine, "features": feature_report}
    if args.features_only:
        (work / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        return report
    seq_len = args.prompt_len + args.new_tokens
    trained_tokens = args.batch * args.anchors * 15
    steps_per_epoch = args.epoch_tokens / seq_len / args.batch
    common = ["--features", str(features_dir), "--steps", str(args.steps),
              "--batch", str(args.batch), "--anchors", str(args.anchors),
              "--eval-every", "0", "--save-every", "0", *device]
    trained_dflash = work / "dflash"
    rows = {"train_dflash": timed_training(
        train_dflash.main, ["--init", str(dflash_dir), "--out", str(trained_dflash), *common],
        args.device, trained_tokens, steps_per_epoch)}
    # At 27B shapes the drafter's resumable state is ~21 GB of the device's 64 GB disk.
    sibling(trained_dflash, ".ckpt").unlink()
    rows["train_weaver"] = timed_training(
        train_weaver.main, ["--dflash", str(trained_dflash), "--out", str(work / "weaver"),
                            *weaver_args, "--eval-budget", "64", *common],
        args.device, trained_tokens, steps_per_epoch)
    report.update(training=rows, epoch_tokens=args.epoch_tokens, batch=args.batch,
                  anchors=args.anchors)
    (work / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'command':<14}{'s/step':>10}{'tokens/s':>12}{'peak GiB':>10}"
          f"{'epoch h':>10}   (epoch = {args.epoch_tokens:.0e} stored tokens)")
    for name, row in rows.items():
        peak = f"{row['peak_gpu_gib']:.1f}" if row["peak_gpu_gib"] is not None else "-"
        print(f"{name:<14}{row['seconds_per_step']:>10.3f}{row['trained_tokens_per_s']:>12.0f}"
              f"{peak:>10}{row['epoch_hours']:>10.2f}")
    return report


if __name__ == "__main__":
    main()
