"""Stored target features: what drafter training reads instead of running the target.

A feature directory (written by `generate_features`) holds, per split ("train",
"heldout"), shards `<split>-<index>.safetensors` of R sequences of T tokens each:

    tokens   [R, T] int32   prompt + target continuation
    sampled  [R]    bool    continuation drawn at T=1 (else greedy)
    aux      [R, T, n * d]  bf16   outputs of the DFlash layers `layer_ids`, concatenated
    final    [R, T, d]      bf16   final-norm hidden states (Weaver's h_v)

plus `head.safetensors` (the target's `embed` [V, d_embed] and `lm_head` [V, d]) and
`manifest.json` (the spec that produced it, the shards and their sha256).

What is kept, and why that is all training needs:
- bf16 states: vLLM hands the drafter bf16 states, so training on bf16 loses nothing the
  engine has.
- No logits. The target's logits at a position are `final @ lm_head.T` (Qwen-style heads
  have no bias or soft-capping), so the target distribution over any pool is recomputed
  exactly from `final` and the LM-head rows of the pool. Storing pools would not work
  anyway: a pool is the DFlash drafter's top-k, and the drafter is trained after the
  features are made. At Qwen3.6-27B shapes a token costs 5 x 5120 x 2 (aux) + 5120 x 2
  (final) + 4 bytes = 61.4 kB; top-512 logits and ids would add 3 kB and say less.
- Every position: a DFlash block at anchor p reads the context at all positions < p,
  prompt included, and Weaver reads `final` at p - 1.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

FORMAT = "vllm_tfm.features/1"
MANIFEST = "manifest.json"
HEAD_FILE = "head.safetensors"
SPLITS = ("train", "heldout")
STATE_DTYPE = torch.bfloat16


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.safetensors"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomically(path: Path, write) -> None:
    """`write(tmp_path)`, then rename: a killed run leaves no half-written `path`."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    tmp.replace(path)


def write_shard(path: Path, tokens: torch.Tensor, sampled: torch.Tensor, aux: torch.Tensor,
                final: torch.Tensor) -> None:
    """One shard (see the module docstring for shapes)."""
    tensors = {
        "tokens": tokens.to(torch.int32).contiguous(),
        "sampled": sampled.to(torch.bool).contiguous(),
        "aux": aux.to(STATE_DTYPE).contiguous(),
        "final": final.to(STATE_DTYPE).contiguous(),
    }
    write_atomically(path, lambda tmp: save_file(tensors, str(tmp)))


def write_head(directory: Path, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
    # Copies: a tied head shares the embedding's storage, which safetensors refuses.
    tensors = {"embed": embed.detach().to("cpu", copy=True).contiguous(),
               "lm_head": lm_head.detach().to("cpu", copy=True).contiguous()}
    write_atomically(directory / HEAD_FILE, lambda tmp: save_file(tensors, str(tmp)))


def read_manifest(directory: str | Path) -> dict | None:
    path = Path(directory) / MANIFEST
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def write_manifest(directory: Path, manifest: dict) -> None:
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    write_atomically(directory / MANIFEST, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def lm_head_logits(final: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """float32 target logits of final-norm states [..., d] through `lm_head` [V, d]."""
    return (final.to(lm_head.dtype) @ lm_head.T).float()


@dataclass(eq=False, repr=False)
class TargetHead:
    """The only target weights drafter training needs: the input embedding [V, d_embed]
    and the LM head [V, d]. Stands in for `Target` (a subclass) wherever only these are
    read (`acceptance.Drafters`, `greedy_tau`)."""

    embed: torch.Tensor
    lm_head: torch.Tensor

    @classmethod
    def load(cls, directory: str | Path, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32) -> TargetHead:
        path = Path(directory) / HEAD_FILE
        if not path.is_file():
            raise ValueError(f"feature directory {str(directory)!r} has no {HEAD_FILE}")
        tensors = load_file(str(path))
        return cls(embed=tensors["embed"].to(device, dtype),
                   lm_head=tensors["lm_head"].to(device, dtype))

    @property
    def device(self) -> torch.device:
        return self.lm_head.device

    @property
    def hidden_size(self) -> int:
        return self.lm_head.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[0]

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """float32 target logits of final-norm states [..., d] -> [..., V]."""
        return lm_head_logits(final, self.lm_head)


@dataclass(frozen=True)
class FeatureBatch:
    """Rows of a feature split: tokens [B, T] int64, aux [B, T, n * d], final [B, T, d]
    (bf16), sampled [B] bool."""

    tokens: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor
    sampled: torch.Tensor


class FeatureSplit:
    """One split of a complete feature directory, read row by row from memory-mapped
    shards (a split may be far larger than memory).

    Attributes:
        manifest: the directory's manifest; prompt_len, seq_len: from its spec.
        num_sequences: rows over all shards.
    """

    def __init__(self, directory: str | Path, split: str, verify: bool = False):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.directory = Path(directory)
        manifest = read_manifest(self.directory)
        if manifest is None or manifest.get("format") != FORMAT:
            raise ValueError(f"{self.directory} is not a feature directory (no {MANIFEST} "
                             f"of format {FORMAT!r}); make one with tools/generate_features.py")
        if not manifest.get("complete"):
            raise ValueError(f"{self.directory}: feature generation has not finished "
                             "(rerun tools/generate_features.py with the same arguments)")
        self.manifest = manifest
        spec = manifest["spec"]
        self.prompt_len = int(spec["prompt_len"])
        self.seq_len = self.prompt_len + int(spec["new_tokens"])
        self.layer_ids = tuple(manifest["layer_ids"])
        shards = manifest["splits"][split]["shards"]
        self._files, self._starts = [], []
        start = 0
        for shard in shards:
            path = self.directory / shard["file"]
            if not path.is_file():
                raise ValueError(f"{path} listed in the manifest is missing")
            if verify and file_sha256(path) != shard["sha256"]:
                raise ValueError(f"{path} does not match its sha256 in the manifest")
            self._files.append(safe_open(str(path), framework="pt"))
            self._starts.append(start)
            start += int(shard["rows"])
        self.num_sequences = start

    def _locate(self, row: int) -> tuple[int, int]:
        if not 0 <= row < self.num_sequences:
            raise IndexError(f"row {row} outside [0, {self.num_sequences})")
        shard = bisect.bisect_right(self._starts, row) - 1
        return shard, row - self._starts[shard]

    def rows(self, indices: Sequence[int] | torch.Tensor) -> FeatureBatch:
        """The rows `indices` (any order, repeats allowed), on the CPU."""
        parts: dict[str, list[torch.Tensor]] = {"tokens": [], "aux": [], "final": [],
                                                "sampled": []}
        for row in torch.as_tensor(indices).tolist():
            shard, local = self._locate(int(row))
            handle = self._files[shard]
            for name, out in parts.items():
                out.append(handle.get_slice(name)[local : local + 1])
        return FeatureBatch(
            tokens=torch.cat(parts["tokens"]).long(), aux=torch.cat(parts["aux"]),
            final=torch.cat(parts["final"]), sampled=torch.cat(parts["sampled"]),
        )

    def all(self) -> FeatureBatch:
        return self.rows(range(self.num_sequences))


@dataclass
class StoredFeatures:
    """What the drafter training commands read from a feature directory: the training
    split (memory-mapped), the held-out split (in memory, all greedy) and the head."""

    train: FeatureSplit
    heldout: FeatureBatch
    head: TargetHead

    @classmethod
    def load(cls, directory: str | Path, device: torch.device | str,
             dtype: torch.dtype = torch.float32) -> StoredFeatures:
        """The head on `device` in `dtype` (fp32: held-out estimates run in fp32, and the
        training steps' autocast casts it); the splits stay on the CPU."""
        train = FeatureSplit(directory, "train")
        heldout = FeatureSplit(directory, "heldout").all()
        if train.num_sequences == 0 or heldout.tokens.shape[0] == 0:
            raise ValueError(f"{directory}: training needs sequences in both splits, got "
                             f"{train.num_sequences} train and {heldout.tokens.shape[0]} "
                             "held-out")
        if bool(heldout.sampled.any()):
            raise ValueError(f"{directory}: held-out continuations must all be greedy "
                             "(acceptance estimates follow them)")
        return cls(train, heldout, TargetHead.load(directory, device, dtype))

    @property
    def prompt_len(self) -> int:
        return self.train.prompt_len

    @property
    def seq_len(self) -> int:
        return self.train.seq_len

    def check_drafter(self, layer_ids: Sequence[int], block_size: int) -> None:
        """The features must hold the drafter's layers, and room after the prompt for one
        block and the token after it (the bonus that acceptance estimates verify)."""
        if tuple(layer_ids) != self.train.layer_ids:
            raise ValueError(f"the drafter reads target layers {list(layer_ids)} but the "
                             f"features hold layers {list(self.train.layer_ids)}")
        if self.seq_len - self.prompt_len <= block_size:
            raise ValueError(f"features continue prompts by {self.seq_len - self.prompt_len} "
                             f"tokens; training needs more than the block size {block_size}")
