"""The target model through transformers: features for training, exact scoring for evaluation.

transformers runs Qwen3-Next's GDN layers through fla whenever fla imports, on any device;
on a CPU that fails (Triton has no CPU driver), so by default `load_causal_lm` hides fla
first and transformers takes its PyTorch fallback. `fla=True` (CUDA, feature generation
at real sizes) keeps fla's kernels; one process cannot have both, since transformers binds
the kernels when its GDN modules are imported.

Layer features follow vLLM's DFlash convention: `target_layer_ids` name decoder layers
whose OUTPUT (the residual stream after the layer) conditions the drafter; "final" is the
final-norm hidden state the LM head reads (Weaver's h_v).
"""

from __future__ import annotations

import copy
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from vllm_tfm.training.features import TargetHead, lm_head_logits


# transformers binds each GDN layer's kernels (fla or its PyTorch fallback) when
# these modules are imported: fla must be hidden before, not merely before
# `import transformers` (vLLM imports transformers without them).
GDN_MODELING_MODULES = (
    "transformers.models.qwen3_next.modeling_qwen3_next",
    "transformers.models.qwen3_5.modeling_qwen3_5",
)


def hide_fla() -> None:
    """Make `import fla` fail so transformers uses its PyTorch GDN. GDN modeling
    modules already imported (bound to fla) are re-imported to rebind them."""
    if sys.modules.get("fla", 0) is None:
        return
    sys.modules["fla"] = None
    for name in GDN_MODELING_MODULES:
        if name in sys.modules:
            importlib.reload(sys.modules[name])


def use_fla() -> None:
    """Make sure transformers binds fla's GDN kernels (raises if they cannot be had)."""
    if sys.modules.get("fla", 0) is None:
        raise ValueError("fla was hidden earlier in this process (a CPU target was loaded): "
                         "run fla=True targets in a process of their own")
    try:
        importlib.import_module("fla")
    except ImportError as error:
        raise ValueError(f"fla=True needs flash-linear-attention importable: {error}") from None


def load_causal_lm(path: str | Path, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32, *, fla: bool = False,
                   random_weights: bool = False, seed: int = 0):
    """A transformers causal LM from a local directory, on `device` in `dtype`.

    fla: keep fla's GDN kernels (CUDA) instead of hiding them. random_weights: build the
    directory's config with transformers' initialisation seeded by `seed` (no weight
    files read: throughput at a real model's shapes).
    """
    use_fla() if fla else hide_fla()
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"target path {str(path)!r} is not a model directory (no config.json)")
    if not random_weights:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                     local_files_only=True)
        return model.to(device)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


@dataclass
class TargetOutput:
    """One target forward over [B, S] tokens.

    final:  [B, S, d] final-norm hidden states.
    aux:    [B, S, n * d] outputs of the requested layers, concatenated in request
            order; None when no layer was requested.
    lm_head: [V, d] the target's LM head (`logits` are computed when read: [B, S, V]
            float32 is far larger than the states at a real vocabulary).
    """

    final: torch.Tensor
    aux: torch.Tensor | None
    lm_head: torch.Tensor

    @property
    def logits(self) -> torch.Tensor:
        """[B, S, V] float32 LM-head logits."""
        return lm_head_logits(self.final, self.lm_head)


class Target(TargetHead):
    """A frozen target (eval mode, no gradients): its head (embed [V, d_embed], lm_head
    [V, d], their device, sizes and `logits`) and the whole model.

    Attributes:
        model: the transformers model.
    """

    def __init__(self, path: str | Path, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, **load_options):
        """`load_options`: `load_causal_lm`'s fla, random_weights, seed."""
        self.path = Path(path)
        model = load_causal_lm(path, device, dtype, **load_options)
        self.model = model.eval().requires_grad_(False)
        self.config = self.model.config
        self.embed = self.model.get_input_embeddings().weight
        self.lm_head = self.model.get_output_embeddings().weight
        self._wanted: tuple[int, ...] = ()
        self._captured: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.model.model.layers):
            layer.register_forward_hook(self._capture(index))

    @property
    def num_layers(self) -> int:
        return len(self.model.model.layers)

    def _capture(self, index: int):
        def hook(module, args, output):
            if index in self._wanted:
                self._captured[index] = output[0] if isinstance(output, tuple) else output

        return hook

    def check_layer_ids(self, layer_ids: Sequence[int]) -> tuple[int, ...]:
        """`layer_ids` as a tuple; each must name a layer before the last (the last
        layer's output is the final stream, which DFlash drafters never read)."""
        ids = tuple(int(i) for i in layer_ids)
        bad = [i for i in ids if not 0 <= i < self.num_layers - 1]
        if bad or not ids:
            raise ValueError(
                f"target_layer_ids must be a non-empty list in [0, {self.num_layers - 1}), "
                f"got {list(layer_ids)}"
            )
        return ids

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, layer_ids: Sequence[int] = (), cache=None,
                start: int = 0) -> TargetOutput:
        """Run [B, S] token ids at positions start..start+S-1, continuing `cache` (a
        transformers cache, updated in place) when given."""
        wanted = self.check_layer_ids(layer_ids) if layer_ids else ()
        positions = torch.arange(start, start + ids.shape[1], device=self.device)
        self._wanted, self._captured = wanted, {}
        try:
            out = self.model.model(
                input_ids=ids.to(self.device),
                position_ids=positions[None].expand(ids.shape[0], -1),
                past_key_values=cache,
                use_cache=cache is not None,
            )
        finally:
            captured, self._wanted, self._captured = self._captured, (), {}
        final = out.last_hidden_state
        aux = torch.cat([captured[i] for i in wanted], -1) if wanted else None
        return TargetOutput(final=final, aux=aux, lm_head=self.lm_head)

    @torch.no_grad()
    def features(self, tokens: torch.Tensor, layer_ids: Sequence[int],
                 batch_size: int | None = None, dtype: torch.dtype = torch.bfloat16,
                 desc: str = "target features"):
        """Layer outputs and final states of every position of `tokens` ([N, T]), run
        `batch_size` rows at a time (default 512 on a GPU, 16 on a CPU).

        Returns (aux [N, T, n * d], final [N, T, d]) on the CPU in `dtype` (bf16 by
        default: vLLM hands the drafter bf16 states too, and it halves the memory).
        """
        aux, final = [], []
        batch_size = batch_size or (512 if self.device.type == "cuda" else 16)
        for start in tqdm(range(0, tokens.shape[0], batch_size), desc=desc, leave=False):
            out = self.forward(tokens[start : start + batch_size], layer_ids)
            aux.append(out.aux.to("cpu", dtype))
            final.append(out.final.to("cpu", dtype))
        return torch.cat(aux), torch.cat(final)

    def session(self, layer_ids: Sequence[int] = ()) -> DecodeSession:
        """An empty decoding session (fresh cache) whose outputs carry `layer_ids`."""
        from transformers import DynamicCache

        return DecodeSession(self, DynamicCache(config=self.config), layer_ids)


class DecodeSession:
    """Incremental decoding of B sequences of equal length over one transformers cache.

    Attributes:
        length: tokens processed so far (positions 0..length-1).
    """

    def __init__(self, target: Target, cache, layer_ids: Sequence[int]):
        self.target = target
        self.cache = cache
        self.layer_ids = tuple(layer_ids)
        self.length = 0

    def extend(self, ids: torch.Tensor) -> TargetOutput:
        """Append [B, k] tokens (k >= 1) to every sequence; returns their outputs."""
        out = self.target.forward(ids, self.layer_ids, self.cache, self.length)
        self.length += ids.shape[1]
        return out

    def score_paths(self, paths: torch.Tensor) -> TargetOutput:
        """Outputs of [L, S] continuations of sequence 0, each run as an ordinary causal
        sequence from a copy of this session's state (the session is unchanged).

        Output s of row l depends on paths[l, :s+1] only, so rows of different lengths
        can be right-padded with any token.
        """
        cache = copy.deepcopy(self.cache)
        # Beam search's reorder: row l of the copy starts as sequence 0.
        cache.reorder_cache(torch.zeros(paths.shape[0], dtype=torch.int64,
                                        device=self.target.device))
        return self.target.forward(paths, self.layer_ids, cache, self.length)
