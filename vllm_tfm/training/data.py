"""Training and evaluation text: Python's standard-library sources (the built-in prompt
source; a site-packages corpus (corpus.py), a JSON-lines file of texts or random ids are the
others, `prompt_windows`) and the target's continuations of prompts.

The modules in `HELDOUT_MODULES` never reach a training batch: evaluation prompts and
held-out losses come from them only. Everything else under the stdlib directory (tests and
installed packages excluded) is training text.

Drafters are trained on TARGET-GENERATED continuations of stdlib prompts, not on the raw
text: a drafter must predict what the target will emit, and a target's output (above all a
random or barely trained tiny target's) is far from the stdlib text itself. Half of the
training continuations are greedy, half are T=1 samples (full softmax, no top-k / top-p),
so the drafter sees both regimes it is evaluated in; held-out continuations are all
greedy, which makes greedy acceptance computable from the text alone (see acceptance.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from vllm_tfm.training import corpus
from vllm_tfm.training.features import file_sha256

# Modules held out of every training set (none is in the tokenizer's corpus either).
HELDOUT_MODULES = (
    "bisect.py",
    "calendar.py",
    "csv.py",
    "fractions.py",
    "glob.py",
    "heapq.py",
    "shlex.py",
    "statistics.py",
    "string.py",
    "tokenize.py",
)
_EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
SPLITS = ("train", "heldout")
ENCODE_SLICE = 256  # documents per batch-encoder call


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(split: str) -> list[Path]:
    """The .py files of one split, sorted: "train" (all but held-out, tests, packages) or
    "heldout" (`HELDOUT_MODULES`)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = stdlib_root()
    heldout = [root / name for name in HELDOUT_MODULES]
    missing = [str(p) for p in heldout if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"held-out standard-library modules missing: {missing}")
    if split == "heldout":
        return heldout
    names = set(HELDOUT_MODULES)
    return sorted(
        path
        for path in root.rglob("*.py")
        if not _EXCLUDED_PARTS & set(path.relative_to(root).parts)
        and str(path.relative_to(root)) not in names
    )


def load_tokenizer(target_dir: str | Path):
    """The target's `tokenizers.Tokenizer` (target_dir/tokenizer.json)."""
    from tokenizers import Tokenizer

    path = Path(target_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"target_dir {str(target_dir)!r} has no tokenizer.json")
    return Tokenizer.from_file(str(path))


def heldout_prompts(tokenizer, count: int, length: int, seed: int = 0) -> torch.Tensor:
    """[count, length] int64 prompts: token windows of the held-out modules."""
    windows = SourceWindows(tokenizer, stdlib_sources("heldout"))
    return windows.sample(count, length, torch.Generator().manual_seed(seed))


class SourceWindows:
    """Random token windows from documents (source files, or texts), each encoded on
    first use.

    A document is drawn with probability proportional to its size in bytes, then a window
    start uniformly; documents too short for the window are redrawn.
    """

    def __init__(self, tokenizer, paths: Sequence[Path] = (), *, texts: Sequence[str] = ()):
        if not paths and not texts:
            raise ValueError("SourceWindows needs at least one source file or text")
        self.tokenizer = tokenizer
        self.documents: list[Path | str] = [*paths, *texts]
        self.weights = torch.tensor(
            [float(d.stat().st_size if isinstance(d, Path) else len(d.encode()))
             for d in self.documents]
        )
        self._ids: dict[int, torch.Tensor] = {}

    def encoded(self, index: int) -> torch.Tensor:
        """Token ids of document `index`, [n] int64."""
        if index not in self._ids:
            document = self.documents[index]
            text = (document.read_text(encoding="utf-8", errors="replace")
                    if isinstance(document, Path) else document)
            self._ids[index] = torch.tensor(self.tokenizer.encode(text).ids, dtype=torch.int64)
        return self._ids[index]

    def encode_all(self, cache: Path | None = None) -> None:
        """Encode every document now, in parallel (the tokenizer's batch encoder), instead of
        one at a time on first use. `cache`: a file that holds the ids of exactly these
        documents under this tokenizer (the caller's key): read when present, else written
        (atomically: processes of a torchrun may race)."""
        if cache is not None and cache.is_file():
            stored = torch.load(cache, weights_only=True)
            parts = stored["ids"].to(torch.int64).split(stored["lengths"].tolist())
            self._ids = dict(enumerate(parts))
            return
        pending = [i for i in range(len(self.documents)) if i not in self._ids]
        texts = [d.read_text(encoding="utf-8", errors="replace") if isinstance(d, Path) else d
                 for d in (self.documents[i] for i in pending)]
        # In slices: an Encoding also holds each token's string and offsets (the whole
        # site-packages corpus at once took 14 GB).
        for start in range(0, len(pending), ENCODE_SLICE):
            encodings = self.tokenizer.encode_batch(texts[start : start + ENCODE_SLICE])
            for index, encoding in zip(pending[start : start + ENCODE_SLICE], encodings):
                self._ids[index] = torch.tensor(encoding.ids, dtype=torch.int64)
        if cache is not None:
            ids = [self._ids[i] for i in range(len(self.documents))]
            staging = cache.with_name(f"{cache.name}.{os.getpid()}")
            torch.save({"ids": torch.cat(ids).to(torch.int32),
                        "lengths": torch.tensor([t.numel() for t in ids])}, staging)
            os.replace(staging, cache)

    @property
    def num_tokens(self) -> int:
        """Tokens in all documents (encodes them all)."""
        self.encode_all()
        return sum(ids.numel() for ids in self._ids.values())

    def sample(self, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """[count, length] int64 windows, drawn with `generator` (CPU)."""
        if count < 0 or length < 1:
            raise ValueError(f"count must be >= 0 and length >= 1, got {count}, {length}")
        rows: list[torch.Tensor] = []
        tries = 0
        while len(rows) < count:
            tries += 1
            if tries > 100 * (count + 1):
                raise ValueError(f"no document holds a window of {length} tokens")
            index = int(torch.multinomial(self.weights, 1, generator=generator))
            ids = self.encoded(index)
            if ids.numel() < length:
                continue
            start = int(torch.randint(0, ids.numel() - length + 1, (1,), generator=generator))
            rows.append(ids[start : start + length])
        return torch.stack(rows) if rows else torch.zeros(0, length, dtype=torch.int64)


class RandomWindows:
    """Uniformly random token ids: prompts for throughput runs on random-weight targets."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def sample(self, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(0, self.vocab_size, (count, length), generator=generator)


def read_jsonl_texts(path: str | Path) -> list[str]:
    """The "text" field of every line of a JSON-lines file."""
    texts = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ValueError(f"{path}:{number}: each line must be an object with a string "
                             "field 'text'")
        texts.append(row["text"])
    if not texts:
        raise ValueError(f"{path} holds no prompts")
    return texts


PROMPT_SOURCES = ("stdlib", f"{corpus.SOURCE_PREFIX}<dir>", "random", "<file>.jsonl")


def prompt_windows(source: str, split: str, target_dir: str | Path, vocab_size: int):
    """Where a split's prompts come from: "stdlib" (windows of the split's standard-library
    modules), "corpus:<dir>" (windows of the split's files of a corpus built by corpus.py),
    "random" (uniform token ids), or a JSON-lines file of {"text": ...} (windows of its
    texts); text is tokenised with target_dir's tokenizer.json (a corpus's all at once)."""
    if source == "random":
        return RandomWindows(vocab_size)
    if source == "stdlib":
        return SourceWindows(load_tokenizer(target_dir), stdlib_sources(split))
    if source.startswith(corpus.SOURCE_PREFIX):
        corpus_dir = Path(source[len(corpus.SOURCE_PREFIX):])
        windows = SourceWindows(load_tokenizer(target_dir),
                                texts=corpus.read_split(corpus_dir, split))
        # Thousands of files: encoded at once, in parallel, and kept beside the corpus for
        # the next stage that reads them with the same tokenizer.
        windows.encode_all(corpus.ids_cache(corpus_dir, split, Path(target_dir) / "tokenizer.json"))
        return windows
    if source.endswith(".jsonl"):
        return SourceWindows(load_tokenizer(target_dir), texts=read_jsonl_texts(source))
    raise ValueError(f"prompts must be one of {PROMPT_SOURCES}, got {source!r}")


@dataclass(frozen=True)
class ContinuationSpec:
    """What a set of target continuations holds (part of a feature directory's spec).

    num_train / num_heldout: sequences per split; prompt_len / new_tokens: tokens of
    prompt and of target continuation; sampled_fraction: share of training
    sequences continued by T=1 sampling (the rest greedy; held-out is all greedy).
    """

    num_train: int
    num_heldout: int
    prompt_len: int = 32
    new_tokens: int = 96
    sampled_fraction: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_train", "num_heldout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("prompt_len", "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.sampled_fraction <= 1.0:
            raise ValueError(f"sampled_fraction must be in [0, 1], got {self.sampled_fraction}")


def add_continuation_args(parser) -> None:
    """The options that define a continuation set."""
    parser.add_argument("--num-seqs", type=int, default=512, help="training sequences")
    parser.add_argument("--heldout-seqs", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--sampled-fraction", type=float, default=0.5)


def continuation_spec(args) -> ContinuationSpec:
    """The ContinuationSpec of parsed `add_continuation_args` options (and --seed)."""
    return ContinuationSpec(
        num_train=args.num_seqs, num_heldout=args.heldout_seqs, prompt_len=args.prompt_len,
        new_tokens=args.new_tokens, sampled_fraction=args.sampled_fraction, seed=args.seed,
    )


@torch.no_grad()
def continue_prompts(
    target,
    prompts: torch.Tensor,
    new_tokens: int,
    sampled: torch.Tensor,
    generator: torch.Generator,
    batch_size: int | None = None,
    desc: str = "generate",
) -> torch.Tensor:
    """Continue `prompts` ([N, L] int64) by `new_tokens` target tokens each.

    Rows with `sampled` ([N] bool) draw from the full T=1 softmax with `generator` (on
    the target's device), the others take the argmax; `batch_size` rows at a time
    (default 1024 on a GPU, 128 on a CPU). Returns [N, L + new_tokens] int64 on the CPU.
    """
    rows = []
    device = target.device
    batch_size = batch_size or (1024 if device.type == "cuda" else 128)
    for start in tqdm(range(0, prompts.shape[0], batch_size), desc=desc, leave=False):
        ids = prompts[start : start + batch_size].to(device)
        draw = sampled[start : start + batch_size].to(device)
        session = target.session()
        logits = target.logits(session.extend(ids).final[:, -1])
        out = [ids]
        for _ in range(new_tokens):
            greedy = logits.argmax(-1)
            drawn = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator)
            token = torch.where(draw, drawn[:, 0], greedy)
            out.append(token[:, None])
            logits = target.logits(session.extend(token[:, None]).final[:, -1])
        rows.append(torch.cat(out, 1).cpu())
    return torch.cat(rows) if rows else prompts.new_zeros(0, prompts.shape[1] + new_tokens)


def target_digest(target_dir: str | Path, weights: bool = True) -> str:
    """sha256 over the target's config and (`weights`) weight files: the key of anything
    derived from the target."""
    digest = hashlib.sha256()
    root = Path(target_dir)
    paths = sorted(root.glob("*.safetensors")) if weights else []
    for path in paths + [root / "config.json"]:
        digest.update(f"{path.name}:{file_sha256(path)}".encode())
    return digest.hexdigest()
