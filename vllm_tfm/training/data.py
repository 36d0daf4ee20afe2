"""Training and evaluation text from Python's standard-library sources.

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
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

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
    """Random token windows from source files, each file encoded on first use.

    A file is drawn with probability proportional to its byte size, then a window start
    uniformly; files too short for the window are redrawn.
    """

    def __init__(self, tokenizer, paths: Sequence[Path]):
        if not paths:
            raise ValueError("paths must name at least one source file")
        self.tokenizer = tokenizer
        self.paths = list(paths)
        self.weights = torch.tensor([float(p.stat().st_size) for p in self.paths])
        self._ids: dict[int, torch.Tensor] = {}

    def encoded(self, index: int) -> torch.Tensor:
        """Token ids of file `index`, [n] int64."""
        if index not in self._ids:
            text = self.paths[index].read_text(encoding="utf-8", errors="replace")
            ids = self.tokenizer.encode(text).ids
            self._ids[index] = torch.tensor(ids, dtype=torch.int64)
        return self._ids[index]

    def sample(self, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """[count, length] int64 windows, drawn with `generator` (CPU)."""
        if count < 0 or length < 1:
            raise ValueError(f"count must be >= 0 and length >= 1, got {count}, {length}")
        rows: list[torch.Tensor] = []
        tries = 0
        while len(rows) < count:
            tries += 1
            if tries > 100 * (count + 1):
                raise ValueError(f"no source file holds a window of {length} tokens")
            index = int(torch.multinomial(self.weights, 1, generator=generator))
            ids = self.encoded(index)
            if ids.numel() < length:
                continue
            start = int(torch.randint(0, ids.numel() - length + 1, (1,), generator=generator))
            rows.append(ids[start : start + length])
        return torch.stack(rows) if rows else torch.zeros(0, length, dtype=torch.int64)


@dataclass(frozen=True)
class ContinuationSpec:
    """What a continuation set holds; part of its cache key.

    num_train / num_heldout: sequences per split; prompt_len / new_tokens: tokens of
    stdlib prompt and of target continuation; sampled_fraction: share of training
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
    """The options that define a continuation set (shared by the drafter tools, so
    both read the same cache when given the same values)."""
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


@dataclass(frozen=True)
class Continuations:
    """Prompt + target continuation sequences.

    tokens:     [N, T] int64, T = prompt_len + new_tokens.
    prompt_len: stdlib tokens at the start of each row; the rest was generated.
    sampled:    [N] bool, True where the continuation is a T=1 sample, False greedy.
    """

    tokens: torch.Tensor
    prompt_len: int
    sampled: torch.Tensor

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]


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
        logits = session.extend(ids).logits[:, -1]
        out = [ids]
        for _ in range(new_tokens):
            greedy = logits.argmax(-1)
            drawn = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator)
            token = torch.where(draw, drawn[:, 0], greedy)
            out.append(token[:, None])
            logits = session.extend(token[:, None]).logits[:, -1]
        rows.append(torch.cat(out, 1).cpu())
    return torch.cat(rows) if rows else prompts.new_zeros(0, prompts.shape[1] + new_tokens)


def target_digest(target_dir: str | Path) -> str:
    """sha256 over the target's config and weight files: the continuation cache key."""
    digest = hashlib.sha256()
    root = Path(target_dir)
    for path in sorted(root.glob("*.safetensors")) + [root / "config.json"]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def build_continuations(target, tokenizer, spec: ContinuationSpec) -> dict[str, Continuations]:
    """Generate both splits: prompts are windows of the split's modules."""
    out = {}
    for split, count in (("train", spec.num_train), ("heldout", spec.num_heldout)):
        seed = spec.seed * 2 + (split == "heldout")
        generator = torch.Generator().manual_seed(seed)
        prompts = SourceWindows(tokenizer, stdlib_sources(split)).sample(
            count, spec.prompt_len, generator
        )
        sampled = torch.zeros(count, dtype=torch.bool)
        if split == "train":
            sampled[: round(count * spec.sampled_fraction)] = True
            sampled = sampled[torch.randperm(count, generator=generator)]
        device_gen = torch.Generator(device=target.device).manual_seed(seed)
        tokens = continue_prompts(
            target, prompts, spec.new_tokens, sampled, device_gen, desc=f"generate {split}"
        )
        out[split] = Continuations(tokens=tokens, prompt_len=spec.prompt_len, sampled=sampled)
    return out


def load_or_build_continuations(
    path: str | Path, target, target_dir: str | Path, spec: ContinuationSpec
) -> dict[str, Continuations]:
    """The continuation sets cached at `path` when they were built for the same target
    bytes and spec; otherwise build them and write `path` (torch.save, read back with
    weights_only=True)."""
    path = Path(path)
    key = {"spec": asdict(spec), "target": target_digest(target_dir)}
    if path.is_file():
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if json.loads(payload["key"]) == key:
            return {
                split: Continuations(
                    tokens=payload[f"{split}_tokens"],
                    prompt_len=spec.prompt_len,
                    sampled=payload[f"{split}_sampled"],
                )
                for split in SPLITS
            }
    sets = build_continuations(target, load_tokenizer(target_dir), spec)
    payload = {"key": json.dumps(key, sort_keys=True)}
    for split, data in sets.items():
        payload[f"{split}_tokens"] = data.tokens
        payload[f"{split}_sampled"] = data.sampled
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)
    return sets
