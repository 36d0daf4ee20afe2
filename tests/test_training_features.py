"""Stored features and training from them (vllm_tfm/training/features.py,
generate_features.py, loop.py): the stored states are the target's, greedy rows are the
target's argmax, a killed generation resumes to the same files, changed arguments are
refused by name, corruption is named; the tiny recipe's features + DFlash + Weaver stages
give the same results on 1 and 2 torchrun processes (gloo) and with gradient accumulation,
up to reduction order; bad batch splits, foreign drafter layers and bad prompt files are
refused by name."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from vllm_tfm.tiny import family as tiny_family
from vllm_tfm.training import (
    data,
    dflash,
    features,
    generate_features,
    target,
    train_dflash,
    train_family,
)

torch.set_num_threads(1)

GENERATE_ARGS = ["--num-seqs", "8", "--heldout-seqs", "2", "--prompt-len", "8",
                 "--new-tokens", "17", "--shard-seqs", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def family():
    return tiny_family.build_family()


@pytest.fixture(scope="module")
def reference(family, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "features"
    report = generate_features.main(["--out", str(out), *GENERATE_ARGS])
    return out, report


def _shard_digests(directory) -> dict[str, str]:
    manifest = features.read_manifest(directory)
    return {s["file"]: s["sha256"] for split in manifest["splits"].values()
            for s in split["shards"]}


def test_features_are_the_targets_states_and_greedy_rows_its_argmax(family, reference):
    out, report = reference
    assert report["tokens"] == 10 * 25 and report["bytes_per_million_tokens"] > 0
    split = features.FeatureSplit(out, "train", verify=True)
    rows = split.all()
    assert split.num_sequences == 8 and rows.tokens.shape == (8, 25)
    assert int(rows.sampled.sum()) == 4  # half of each 2-row shard is sampled
    again = split.rows([5, 0, 5])
    assert torch.equal(again.aux[0], rows.aux[5]) and torch.equal(again.final[2], rows.final[5])
    model = target.Target(family.target)
    layer_ids = tiny_family.DFLASH_TARGET_LAYER_IDS
    full = model.forward(rows.tokens, layer_ids)
    for stored, fresh in ((rows.aux, full.aux), (rows.final, full.final)):
        assert stored.dtype == torch.bfloat16 and torch.isfinite(stored.float()).all()
        error = (stored.float() - fresh).norm() / fresh.norm()
        assert error <= 1e-2, f"stored states differ from the target's: {error:.2e}"
    # Greedy continuations follow the target's argmax (up to ties, by top-2 margin).
    held = features.FeatureSplit(out, "heldout").all()
    greedy = torch.cat([rows.tokens[~rows.sampled], held.tokens])
    logits = model.forward(greedy).logits[:, 7:-1]
    top2 = logits.topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-3
    assert clear.float().mean() > 0.9
    assert torch.equal(logits.argmax(-1)[clear], greedy[:, 8:][clear])
    head = features.TargetHead.load(out)
    assert torch.equal(head.lm_head, model.lm_head) and torch.equal(head.embed, model.embed)


def test_killed_generation_resumes_to_the_same_files(family, reference, tmp_path):
    out = tmp_path / "features"
    command = [sys.executable, "-m", "vllm_tfm.training.generate_features", "--out", str(out),
               *GENERATE_ARGS]
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = out / features.shard_name("train", 0)
    deadline = time.monotonic() + 300
    while not first.is_file() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    made = sorted(p.name for p in out.glob("*-*.safetensors"))
    assert first.name in made and len(made) < 5, f"the kill came too late: {made}"
    assert not features.read_manifest(out)["complete"]
    with pytest.raises(ValueError, match="not finished"):
        features.FeatureSplit(out, "train")
    # A half-written shard left by a kill is never taken for a shard.
    (out / (features.shard_name("train", 3) + ".tmp")).write_bytes(b"partial")

    generate_features.main(["--out", str(out), *GENERATE_ARGS])
    assert _shard_digests(out) == _shard_digests(reference[0])
    assert features.file_sha256(out / features.HEAD_FILE) == features.file_sha256(
        reference[0] / features.HEAD_FILE)

    with pytest.raises(ValueError, match="new_tokens"):
        generate_features.main(["--out", str(out), *GENERATE_ARGS, "--new-tokens", "12"])
    shard = out / features.shard_name("train", 1)
    damaged = bytearray(shard.read_bytes())
    damaged[-1] ^= 0xFF
    shard.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match="train-00001.safetensors does not match"):
        features.FeatureSplit(out, "train", verify=True)


def _checkpoint_states(path) -> dict[str, torch.Tensor]:
    payload = torch.load(path, map_location="cpu", weights_only=True)
    (states,) = payload["modules"].values()
    return states


def _assert_close(left, right, what: str) -> None:
    for key, value in left.items():
        other = right[key]
        assert torch.isfinite(value).all() and torch.isfinite(other).all(), key
        error = (value.float() - other.float()).norm() / value.float().norm().clamp(min=1e-12)
        assert error <= 1e-5, f"{what}: {key} differs by {error:.2e}"


def test_one_and_two_processes_and_accumulation_train_the_same(family, tmp_path):
    options = ["--base", str(family.root), "--smoke", "--device", "cpu"]
    stages = ["--stages", "features", "dflash", "weaver", *options]
    one, two = tmp_path / "one", tmp_path / "two"
    # The family's random target stands in for the trained one (the target stage is
    # tests/test_training_tools.py's).
    for run in (one, two):
        shutil.copytree(family.target, run / "family" / "target")
    train_family.main(["--out", str(one / "family"), "--work", str(one / "work"), *stages])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master-port", str(29400 + os.getpid() % 500), "-m",
         "vllm_tfm.training.train_family", "--out", str(two / "family"),
         "--work", str(two / "work"), *stages],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Shards are split over the processes but each depends on (seed, split, index) only.
    assert _shard_digests(one / "work" / "features") == _shard_digests(two / "work" / "features")
    start = dflash.DFlashDrafter.load(family.dflash, tiny_family.HIDDEN).state_dict()
    for name in ("dflash", "weaver"):
        single = _checkpoint_states(one / "work" / f"{name}.ckpt")
        _assert_close(single, _checkpoint_states(two / "work" / f"{name}.ckpt"),
                      f"{name}, 2 processes")
    dflash_states = _checkpoint_states(one / "work" / "dflash.ckpt")
    assert any(not torch.equal(v, start[k].float()) for k, v in dflash_states.items())
    history = json.loads((two / "work" / "results.json").read_text())["weaver"]["history"]
    assert [h["step"] for h in history] == [0, 2]

    # Gradient accumulation: 2 micro-batches of 1 == the 1-process batch of 2.
    recipe = train_family.recipe(one / "family", one / "work", family.root, "cpu", True)
    args = recipe["dflash"]
    args[args.index("--checkpoint") + 1] = str(tmp_path / "accumulated.ckpt")
    args[args.index("--out") + 1] = str(tmp_path / "accumulated")
    train_dflash.main([*args, "--accumulate", "2"])
    _assert_close(dflash_states, _checkpoint_states(tmp_path / "accumulated.ckpt"),
                  "dflash, accumulation")


def test_every_recipe_generates_features_on_pytorch_gdn_on_cuda_too(tmp_path):
    """The recipe's stages share one process and its target stage hides fla, so features
    from a CUDA target must not ask for fla (the H100 run of the tiny recipe failed so)."""
    for corpus_dir in (None, tmp_path / "corpus"):
        args = train_family.recipe(tmp_path / "family", tmp_path / "work", tmp_path / "base",
                                   "cuda", False, corpus_dir)["features"]
        assert args[args.index("--fla") + 1] == "off"


def test_training_refuses_bad_batches_and_foreign_layers(family, reference, tmp_path):
    out = reference[0]
    common = ["--features", str(out), "--out", str(tmp_path / "dflash"), "--device", "cpu"]
    with pytest.raises(ValueError, match=r"--batch \(3\) must be a positive multiple"):
        train_dflash.main([*common, "--batch", "3", "--accumulate", "2"])
    config = json.loads((family.dflash / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 2, 4]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"reads target layers \[0, 2, 4\] but the features "
                                         r"hold layers \[1, 3, 6\]"):
        train_dflash.main([*common, "--init", str(tmp_path / "other")])


def test_prompt_sources_jsonl_random_and_their_errors(family, tmp_path):
    texts = tmp_path / "prompts.jsonl"
    texts.write_text(json.dumps({"text": "def main(argv):\n    return len(argv) * 2\n"}) + "\n\n"
                     + json.dumps({"text": "import os\nprint(os.getcwd())\n"}) + "\n")
    windows = data.prompt_windows(str(texts), "train", family.target, tiny_family.VOCAB_SIZE)
    generator = torch.Generator().manual_seed(0)
    sample = windows.sample(5, 6, generator)
    assert sample.shape == (5, 6) and sample.dtype == torch.int64
    encoded = [windows.encoded(i).tolist() for i in range(2)]
    for row in sample.tolist():  # every window is a slice of one of the texts
        assert any(row == ids[s : s + 6] for ids in encoded for s in range(len(ids) - 5))
    random = data.prompt_windows("random", "heldout", family.target, 7).sample(3, 4, generator)
    assert random.shape == (3, 4) and int(random.max()) < 7
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"prompt": "no"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2: .*string field 'text'"):
        data.prompt_windows(str(bad), "train", family.target, 7)
    with pytest.raises(ValueError, match="prompts must be one of"):
        data.prompt_windows("prompts.txt", "train", family.target, 7)
    with pytest.raises(ValueError, match="--heldout-prompts must name a second file"):
        generate_features.main(["--out", str(tmp_path / "f"), "--prompts", str(texts),
                                "--device", "cpu"])
