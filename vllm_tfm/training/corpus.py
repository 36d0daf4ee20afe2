"""A Python-source training corpus from a site-packages tree, split by package.

    python tools/build_corpus.py --out artifacts/sharp_corpus [--root SITE_PACKAGES] \
        [--heldout networkx rich ...] [--vocab-size 2048]

Every `.py` file under --root (default: this interpreter's site-packages, the packages the
project's setup installs) belongs to the PACKAGE named by its first path part (`foo.py` at
the top level is package `foo`). Packages in `HELDOUT_PACKAGES` (or --heldout) form the
held-out split, every other package the training split, so no file of a held-out package
(and no training file with the same bytes as one) is ever trained on. Left out: `__pycache__`,
`*.dist-info` / `*.egg-info`, editable-install finders, files over `MAX_FILE_BYTES` (generated
tables, not code) and files that are not UTF-8; exact duplicates are kept once.

Output (`--out`): `train.jsonl.xz` and `heldout.jsonl.xz`, one JSON object
{"package", "path", "text"} per file in path order; `tokenizer.json` and
`tokenizer_config.json`, a byte-level BPE trained on the training split
(`vllm_tfm.tiny.family.train_tokenizer`); `manifest.json`: per package its split, file count,
bytes and sha256, the sha256 of every held-out file, each split's sha256 (of its
uncompressed lines and of its .xz file) and what was left out and why.

The bytes are a function of the tree's files alone (sorted walk, fixed compression preset),
so the same tree gives the same corpus. It is built once on the development machine and
carried to the GPU machine: that machine's Python has other packages, so rebuilding there
would give another corpus (`read_split` checks the carried files' sha256).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Held out of training: four unrelated code bases (graphs, terminal rendering, async HTTP,
# command lines), about 3% of the site-packages sources here.
HELDOUT_PACKAGES = ("aiohttp", "click", "networkx", "rich")
MAX_FILE_BYTES = 512 * 1024
FORMAT = "vllm_tfm.corpus/1"
SPLITS = ("train", "heldout")
SPLIT_FILE = "{split}.jsonl.xz"
MANIFEST = "manifest.json"
XZ_PRESET = 9
SOURCE_PREFIX = "corpus:"


def site_packages_root() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def package_of(relative: Path) -> str:
    """The package a file belongs to: its first path part (`foo.py` -> `foo`)."""
    first = relative.parts[0]
    return first[: -len(".py")] if len(relative.parts) == 1 else first


def _skipped_dir(part: str) -> bool:
    return part == "__pycache__" or part.endswith((".dist-info", ".egg-info"))


@dataclass(frozen=True)
class SourceFile:
    package: str
    path: str
    text: str
    sha256: str


def scan(root: Path) -> tuple[list[SourceFile], dict[str, int]]:
    """Every kept file under `root` in path order, and the counts of those left out by reason."""
    kept: list[SourceFile] = []
    skipped = {"too_large": 0, "not_utf8": 0}
    # Sorted by path parts, not by Path (whose ordering changed between Python versions).
    for relative in sorted((p.relative_to(root) for p in root.rglob("*.py")),
                           key=lambda r: r.parts):
        path = root / relative
        if any(_skipped_dir(part) for part in relative.parts[:-1]):
            continue
        if relative.name.startswith("__editable__"):
            continue
        raw = path.read_bytes()
        if len(raw) > MAX_FILE_BYTES:
            skipped["too_large"] += 1
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            continue
        kept.append(SourceFile(package_of(relative), relative.as_posix(), text,
                               hashlib.sha256(raw).hexdigest()))
    return kept, skipped


def split_files(files: list[SourceFile], heldout: tuple[str, ...]) -> dict[str, list[SourceFile]]:
    """Files by split; held-out files first claim their contents, so a training file with
    the bytes of a held-out one (a vendored copy) is dropped, and so is any later duplicate."""
    present = {f.package for f in files}
    missing = sorted(set(heldout) - present)
    if missing:
        raise ValueError(f"heldout packages {missing} are not in the tree "
                         f"(packages present: {len(present)})")
    splits: dict[str, list[SourceFile]] = {split: [] for split in SPLITS}
    seen: set[str] = set()
    for split in ("heldout", "train"):
        for f in files:
            if (f.package in heldout) == (split == "heldout") and f.sha256 not in seen:
                seen.add(f.sha256)
                splits[split].append(f)
    return splits


def _lines(files: list[SourceFile]) -> bytes:
    return b"".join(
        json.dumps({"package": f.package, "path": f.path, "text": f.text},
                   ensure_ascii=False).encode() + b"\n"
        for f in files
    )


def _digest(files: list[SourceFile]) -> str:
    return hashlib.sha256("".join(f"{f.path}:{f.sha256}\n" for f in files).encode()).hexdigest()


def build_corpus(root: str | Path, out: str | Path,
                 heldout: tuple[str, ...] = HELDOUT_PACKAGES, *,
                 vocab_size: int = 2048) -> dict:
    """Build the corpus of `root`'s sources into `out` (see the module docstring); returns
    the manifest."""
    from vllm_tfm.tiny.family import train_tokenizer

    root, out = Path(root), Path(out)
    if not root.is_dir():
        raise ValueError(f"root {str(root)!r} is not a directory")
    files, skipped = scan(root)
    splits = split_files(files, tuple(heldout))
    skipped["duplicate"] = len(files) - sum(len(s) for s in splits.values())
    out.mkdir(parents=True, exist_ok=True)
    manifest_splits = {}
    for split, members in splits.items():
        lines = _lines(members)
        path = out / SPLIT_FILE.format(split=split)
        path.write_bytes(lzma.compress(lines, preset=XZ_PRESET))
        manifest_splits[split] = {
            "file": path.name, "files": len(members), "text_bytes": len(lines),
            "sha256_lines": hashlib.sha256(lines).hexdigest(),
            "sha256_file": hashlib.sha256(path.read_bytes()).hexdigest(),
        }
    packages = {}
    for split, members in splits.items():
        for name in sorted({f.package for f in members}):
            own = [f for f in members if f.package == name]
            packages[name] = {"split": split, "files": len(own),
                              "bytes": sum(len(f.text.encode()) for f in own),
                              "sha256": _digest(own)}
    train_tokenizer([f.text for f in splits["train"]], out, vocab_size)
    manifest = {
        "format": FORMAT,
        "root": str(root),
        "heldout_packages": list(heldout),
        "max_file_bytes": MAX_FILE_BYTES,
        "skipped": skipped,
        "splits": manifest_splits,
        "packages": packages,
        "heldout_files": {f.path: f.sha256 for f in splits["heldout"]},
        "tokenizer": {"vocab_size": vocab_size, "trained_on": "train",
                      "sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def read_manifest(corpus: str | Path) -> dict:
    path = Path(corpus) / MANIFEST
    if not path.is_file():
        raise ValueError(f"corpus {str(corpus)!r} has no {MANIFEST} (tools/build_corpus.py)")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("format") != FORMAT:
        raise ValueError(f"corpus {str(corpus)!r}: format must be {FORMAT!r}, "
                         f"got {manifest.get('format')!r}")
    return manifest


def read_split(corpus: str | Path, split: str) -> list[str]:
    """The texts of one split, after checking its file against the manifest's sha256."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    entry = read_manifest(corpus)["splits"][split]
    packed = (Path(corpus) / entry["file"]).read_bytes()
    if hashlib.sha256(packed).hexdigest() != entry["sha256_file"]:
        raise ValueError(f"corpus {str(corpus)!r}: {entry['file']} is altered (sha256 mismatch)")
    return [json.loads(line)["text"] for line in lzma.decompress(packed).splitlines()]


def ids_cache(corpus: str | Path, split: str, tokenizer_file: Path) -> Path:
    """Where a split's token ids under one tokenizer are kept (`SourceWindows.encode_all`),
    named by the split's and the tokenizer's sha256: under the temporary directory, not in
    the corpus, which is carried to other machines (the ids take 4 bytes a token)."""
    lines = read_manifest(corpus)["splits"][split]["sha256_lines"]
    key = hashlib.sha256(f"{lines}:".encode() + tokenizer_file.read_bytes()).hexdigest()
    folder = Path(tempfile.gettempdir()) / "vllm_tfm_corpus_ids"
    folder.mkdir(exist_ok=True)
    return folder / f"{split}.{key[:32]}.pt"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="corpus directory to write")
    parser.add_argument("--root", help="site-packages tree (default: this interpreter's)")
    parser.add_argument("--heldout", nargs="+", default=list(HELDOUT_PACKAGES))
    parser.add_argument("--vocab-size", type=int, default=2048)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    manifest = build_corpus(args.root or site_packages_root(), args.out, tuple(args.heldout),
                            vocab_size=args.vocab_size)
    print(json.dumps({"skipped": manifest["skipped"], "splits": manifest["splits"]}, indent=1))
    return manifest


if __name__ == "__main__":
    main()
