"""The site-packages corpus (vllm_tfm/training/corpus.py) on a small fake tree: split by
package, what is left out, duplicates, hashes, byte-identical rebuilds, and its use as
training text and prompts."""

from __future__ import annotations

import hashlib
import json
import lzma
import sysconfig
from pathlib import Path

import pytest

from vllm_tfm.training import corpus, data, train_target

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Real Python text for the fake packages (enough for a BPE of a few hundred merges).
SOURCES = ("textwrap.py", "difflib.py", "shlex.py", "glob.py", "fnmatch.py", "bisect.py")
VOCAB = 400


def fake_tree(root: Path) -> Path:
    files = {
        "alpha/__init__.py": STDLIB / SOURCES[0],
        "alpha/sub/deep.py": STDLIB / SOURCES[1],
        "beta/core.py": STDLIB / SOURCES[2],
        "single.py": STDLIB / SOURCES[3],
        "held/__init__.py": STDLIB / SOURCES[4],
        "held/util.py": STDLIB / SOURCES[5],
        # A vendored copy of a held-out file and a duplicate of a training file.
        "beta/_vendor/util.py": STDLIB / SOURCES[5],
        "gamma/copy.py": STDLIB / SOURCES[2],
    }
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(source.read_bytes())
    for junk in ("alpha/__pycache__/x.py", "beta-1.0.dist-info/y.py",
                 "__editable___thing_finder.py"):
        (root / junk).parent.mkdir(parents=True, exist_ok=True)
        (root / junk).write_text("junk = 1\n")
    (root / "gamma" / "table.py").write_text("x = 1\n" * (corpus.MAX_FILE_BYTES // 6 + 1))
    (root / "gamma" / "latin1.py").write_bytes(b"s = '\xe9'\n")
    (root / "gamma" / "notes.txt").write_text("not python\n")
    return root


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = fake_tree(tmp_path_factory.mktemp("site"))
    out = tmp_path_factory.mktemp("corpus")
    manifest = corpus.build_corpus(root, out, ("held",), vocab_size=VOCAB)
    return root, out, manifest


def test_split_is_by_package_and_leaves_out_what_it_says(built):
    root, out, manifest = built
    packages = {name: entry["split"] for name, entry in manifest["packages"].items()}
    assert packages == {"alpha": "train", "beta": "train", "single": "train",
                        "held": "heldout"}
    assert manifest["skipped"] == {"too_large": 1, "not_utf8": 1, "duplicate": 2}
    heldout = {"held/__init__.py", "held/util.py"}
    assert manifest["heldout_files"] == {
        name: hashlib.sha256((root / name).read_bytes()).hexdigest() for name in heldout}
    lines = [json.loads(line) for line in
             lzma.decompress((out / "train.jsonl.xz").read_bytes()).splitlines()]
    assert [row["path"] for row in lines] == ["alpha/__init__.py", "alpha/sub/deep.py",
                                              "beta/core.py", "single.py"]
    train_texts = corpus.read_split(out, "train")
    heldout_texts = corpus.read_split(out, "heldout")
    assert train_texts == [(root / row["path"]).read_text() for row in lines]
    # No held-out bytes reach training, not even as a vendored copy.
    assert not set(heldout_texts) & set(train_texts)
    assert sorted(heldout_texts) == sorted((root / n).read_text() for n in heldout)
    for split, texts in (("train", train_texts), ("heldout", heldout_texts)):
        entry = manifest["splits"][split]
        assert entry["files"] == len(texts)
        assert entry["sha256_file"] == hashlib.sha256(
            (out / entry["file"]).read_bytes()).hexdigest()
    assert manifest["tokenizer"]["vocab_size"] == VOCAB
    assert data.load_tokenizer(out).get_vocab_size() == VOCAB


def test_the_same_tree_gives_the_same_bytes(built, tmp_path):
    root, out, _ = built
    again = tmp_path / "again"
    corpus.build_corpus(root, again, ("held",), vocab_size=VOCAB)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (out / name).read_bytes() == (again / name).read_bytes(), name


def test_bad_inputs_are_named(built, tmp_path):
    root, out, _ = built
    with pytest.raises(ValueError, match=r"heldout packages \['nowhere'\] are not in the tree"):
        corpus.build_corpus(root, tmp_path / "x", ("held", "nowhere"), vocab_size=VOCAB)
    with pytest.raises(ValueError, match="split must be one of"):
        corpus.read_split(out, "test")
    altered = tmp_path / "altered"
    altered.mkdir()
    for path in out.iterdir():
        (altered / path.name).write_bytes(path.read_bytes())
    packed = bytearray((altered / "heldout.jsonl.xz").read_bytes())
    packed[-1] ^= 0xFF
    (altered / "heldout.jsonl.xz").write_bytes(bytes(packed))
    with pytest.raises(ValueError, match="heldout.jsonl.xz is altered"):
        corpus.read_split(altered, "heldout")
    with pytest.raises(ValueError, match="has no manifest.json"):
        corpus.read_manifest(tmp_path)


def test_corpus_windows_come_from_their_split(built, monkeypatch):
    _, out, _ = built
    source = f"{corpus.SOURCE_PREFIX}{out}"
    # Encoded here, not read from a run before, and in slices of 3 of the 4 documents.
    corpus.ids_cache(out, "train", out / "tokenizer.json").unlink(missing_ok=True)
    monkeypatch.setattr(data, "ENCODE_SLICE", 3)
    held = data.prompt_windows(source, "heldout", out, VOCAB)
    train = data.prompt_windows(source, "train", out, VOCAB)
    tokenizer = data.load_tokenizer(out)
    heldout_ids = [tokenizer.encode(t).ids for t in corpus.read_split(out, "heldout")]
    windows = held.sample(6, 16, data.torch.Generator().manual_seed(0))
    for row in windows.tolist():
        assert any(any(ids[i:i + 16] == row for i in range(len(ids) - 15))
                   for ids in heldout_ids)
    # Encoded at once (batch encoder) = one by one on first use.
    one_by_one = data.SourceWindows(tokenizer, texts=corpus.read_split(out, "train"))
    lazy = [one_by_one.encoded(i).tolist() for i in range(len(one_by_one.documents))]
    assert [train.encoded(i).tolist() for i in range(len(lazy))] == lazy
    assert train.num_tokens == sum(map(len, lazy))
    # The next reader of a split takes the ids the first one kept (marked here by a shift).
    cache = corpus.ids_cache(out, "train", out / "tokenizer.json")
    kept = data.torch.load(cache, weights_only=True)
    data.torch.save({**kept, "ids": kept["ids"] + 1}, cache)
    again = data.prompt_windows(source, "train", out, VOCAB)
    assert [(again.encoded(i) - 1).tolist() for i in range(len(lazy))] == lazy
    cache.unlink()
    with pytest.raises(ValueError, match="--text must be stdlib or corpus:DIR"):
        train_target.main(["--out", str(out / "x"), "--text", "random"])


def test_sharp_recipe_smoke_run_writes_a_family_within_its_size_budget(built, tmp_path):
    from vllm_tfm.drafting.weaver_checkpoint import load_weaver
    from vllm_tfm.tiny import family as tiny_family
    from vllm_tfm.training import dflash, target, train_family

    _, out, corpus_manifest = built
    family_dir = tmp_path / "family"
    argv = ["--recipe", "sharp", "--corpus", str(out), "--out", str(family_dir),
            "--work", str(tmp_path / "work"), "--smoke", "--device", "cpu"]
    manifest = train_family.main(argv)
    assert set(manifest["recipe"]) == set(manifest["results"]) == {
        "target", "features", "dflash", "weaver"}
    assert manifest["command"].endswith(" ".join(argv))
    assert f"--text {corpus.SOURCE_PREFIX}{out}" in manifest["recipe"]["target"]
    assert f"--prompts {corpus.SOURCE_PREFIX}{out}" in manifest["recipe"]["features"]
    assert manifest["data"]["heldout_packages"] == {"held": corpus_manifest["packages"]["held"]}
    assert json.loads((family_dir / "corpus.json").read_text()) == corpus_manifest
    results = manifest["results"]["target"]
    assert results["tokens_read"] == 2 * 2 * 32 and results["text_tokens"] > 0
    assert results["epochs"] == results["tokens_read"] / results["text_tokens"]

    loaded = tiny_family.trained_family(family_dir)
    config = json.loads((loaded.target / "config.json").read_text())
    assert (config["vocab_size"], config["num_experts"], config["num_experts_per_tok"]) == (
        VOCAB, 4, 2)
    hidden = train_family.SHARP_TARGET["hidden_size"]
    target.Target(loaded.target)
    dflash.DFlashDrafter.load(loaded.dflash, hidden)
    weaver = load_weaver(loaded.weaver, target_hidden_size=hidden)
    assert weaver.config.d_rank == 192

    # The smoke run has the real architecture: at the real corpus's 2048-token vocabulary
    # (embedding and LM head grow) the three members stay within ~40 MB.
    weights = sum((member / "model.safetensors").stat().st_size
                  for member in (loaded.target, loaded.dflash, loaded.weaver))
    assert weights + 2 * (2048 - VOCAB) * hidden * 2 <= 40e6

    with pytest.raises(ValueError, match="--corpus is needed by --recipe sharp"):
        train_family.main(["--recipe", "sharp", "--out", str(tmp_path / "x")])
