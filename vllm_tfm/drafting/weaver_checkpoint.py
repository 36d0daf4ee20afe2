"""Reading and writing Weaver checkpoints.

Two formats:

- Public ``.pth``: ``torch.save({'config': {...}, 'state_dict': {...}, 'metadata':
  {'speculator_kind': 'dflash_tfm_weaver', ...}})``. A ``.pth`` is a pickle, so it is
  read ONLY with ``torch.load(weights_only=True)``; a file that needs anything more
  is refused, never unpickled in full.
- Directory: ``config.json`` = ``{"config": {...}, "metadata": {...}}`` (the same
  fields, JSON) beside ``model.safetensors`` holding the state dict. Written by our
  training tool.

The block layout ("learned_pos" or "rope_swiglu", see weaver.py) is read off the
state-dict keys; every key, missing or extra, and every shape is checked by name.
"""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from vllm_tfm.drafting.weaver import Weaver, WeaverConfig, WeaverRMSNorm

SPECULATOR_KIND = "dflash_tfm_weaver"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Block-0 keys that identify each layout.
_LAYOUT_MARKERS = {
    "learned_pos": "blocks.0.q_proj.weight",
    "rope_swiglu": "blocks.0.qkv_proj.weight",
}


def load_weaver(
    path: str | Path,
    target_hidden_size: int | None = None,
    target_vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Weaver:
    """Load a Weaver from a public ``.pth`` file or a config.json + model.safetensors directory.

    Args:
        path: the ``.pth`` file or the directory.
        target_hidden_size: when given, ``config.d_model`` must equal it.
        target_vocab_size: when given, ``prepare_tables`` will only accept tables
            with this many rows.
        dtype, device: where the parameters end up.

    Returns:
        The Weaver in eval mode; call ``prepare_tables`` before drafting.
    """
    path = Path(path)
    if path.is_dir():
        payload = _read_directory(path)
    elif path.is_file():
        payload = _read_public_file(path)
    else:
        raise ValueError(f"path {str(path)!r} is neither a checkpoint file nor a directory")
    weaver = _build(payload, str(path))
    if target_hidden_size is not None and weaver.config.d_model != target_hidden_size:
        raise ValueError(
            f"{path}: config.d_model = {weaver.config.d_model} but the target hidden size "
            f"is {target_hidden_size}"
        )
    if target_vocab_size is not None:
        if target_vocab_size < 1:
            raise ValueError(f"target_vocab_size must be positive, got {target_vocab_size}")
        weaver.vocab_size = target_vocab_size
    return weaver.to(device=device, dtype=dtype).eval()


def save_weaver_public(
    weaver: Weaver, path: str | Path, metadata: dict[str, Any] | None = None
) -> None:
    """Write ``weaver`` as a public ``.pth`` (config, state_dict, metadata)."""
    torch.save(
        {
            "config": weaver.config.to_public_dict(),
            "state_dict": _plain_state_dict(weaver),
            "metadata": _metadata(metadata),
        },
        Path(path),
    )


def save_weaver_safetensors(
    weaver: Weaver, directory: str | Path, metadata: dict[str, Any] | None = None
) -> None:
    """Write ``weaver`` as ``directory/config.json`` + ``directory/model.safetensors``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    header = {"config": weaver.config.to_dict(), "metadata": _metadata(metadata)}
    (directory / CONFIG_FILE).write_text(json.dumps(header, indent=2, sort_keys=True) + "\n")
    save_file(_plain_state_dict(weaver), str(directory / WEIGHTS_FILE))


def random_weaver(config: WeaverConfig, seed: int) -> Weaver:
    """A Weaver with small random weights, the same for the same (config, seed).

    Linear weights ~ N(0, 1/fan_in), biases and ``pos_emb`` ~ N(0, 0.1^2), norm
    weights ~ 1 + N(0, 0.1^2) and norm biases ~ N(0, 0.1^2), drawn in parameter order
    from one CPU generator.
    """
    weaver = Weaver(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in weaver.named_parameters():
            owner_name, _, leaf = name.rpartition(".")
            owner = weaver.get_submodule(owner_name)
            noise = torch.randn(param.shape, generator=gen)
            if isinstance(owner, torch.nn.Linear) and leaf == "weight":
                param.copy_(noise / math.sqrt(param.shape[1]))
            elif isinstance(owner, WeaverRMSNorm) and leaf == "weight":
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.1 * noise)
    return weaver.eval()


def _metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
    out = dict(metadata or {})
    kind = out.setdefault("speculator_kind", SPECULATOR_KIND)
    if kind != SPECULATOR_KIND:
        raise ValueError(f"metadata.speculator_kind must be {SPECULATOR_KIND!r}, got {kind!r}")
    try:
        json.dumps(out)
    except TypeError as err:
        raise ValueError(f"metadata must hold plain JSON values only: {err}") from err
    return out


def _plain_state_dict(weaver: Weaver) -> dict[str, torch.Tensor]:
    # Fresh contiguous CPU copies: safetensors refuses shared or strided storage,
    # and torch.save would otherwise write whole storages behind views.
    state = weaver.state_dict()
    return {key: t.detach().to("cpu", copy=True).contiguous() for key, t in state.items()}


def _read_public_file(path: Path) -> dict[str, Any]:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path}: refused: torch.load(weights_only=True) cannot read it (it needs objects "
            f"beyond tensors and plain containers, or it is not a torch checkpoint); it will "
            f"not be unpickled in full. Cause: {str(err).splitlines()[0]}"
        ) from err
    if not isinstance(payload, dict):
        raise ValueError(
            f"{path}: a public Weaver checkpoint is a dict, got {type(payload).__name__}"
        )
    return payload


def _read_directory(path: Path) -> dict[str, Any]:
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    for needed in (config_path, weights_path):
        if not needed.is_file():
            raise ValueError(f"{path}: a Weaver checkpoint directory needs {needed.name}")
    try:
        header = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path}: not valid JSON: {err}") from err
    if not isinstance(header, dict):
        raise ValueError(f"{config_path}: must hold a JSON object, got {type(header).__name__}")
    return {**header, "state_dict": load_file(str(weights_path))}


def _build(payload: dict[str, Any], source: str) -> Weaver:
    extra_fields = sorted(set(payload) - {"config", "state_dict", "metadata"})
    if extra_fields:
        raise ValueError(f"{source}: unexpected top-level fields {extra_fields}")
    for key in ("config", "state_dict", "metadata"):
        if not isinstance(payload.get(key), dict):
            found = type(payload.get(key)).__name__
            raise ValueError(f"{source}: field {key!r} must be a dict, got {found}")
    kind = payload["metadata"].get("speculator_kind")
    if kind != SPECULATOR_KIND:
        raise ValueError(
            f"{source}: metadata.speculator_kind must be {SPECULATOR_KIND!r}, got {kind!r}"
        )
    state_dict = payload["state_dict"]
    not_tensors = sorted(k for k, v in state_dict.items() if not isinstance(v, torch.Tensor))
    if not_tensors:
        raise ValueError(f"{source}: state_dict entries that are not tensors: {not_tensors}")
    try:
        config = WeaverConfig.from_dict(payload["config"], layout=_detect_layout(state_dict))
        # Parameters are allocated on the meta device: shape checks cost nothing and
        # the checkpoint's tensors become the parameters.
        with torch.device("meta"):
            weaver = Weaver(config)
        _check_state_dict(weaver, state_dict)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from err
    weaver.load_state_dict(state_dict, strict=True, assign=True)
    return weaver


def _detect_layout(state_dict: dict[str, torch.Tensor]) -> str:
    found = [layout for layout, marker in _LAYOUT_MARKERS.items() if marker in state_dict]
    if len(found) != 1:
        block_keys = sorted(key for key in state_dict if key.startswith("blocks.0."))
        raise ValueError(
            "state_dict must hold exactly one block layout: "
            + ", ".join(f"{m!r} ({layout})" for layout, m in _LAYOUT_MARKERS.items())
            + f"; its blocks.0 keys are {block_keys}"
        )
    return found[0]


def _check_state_dict(weaver: Weaver, state_dict: dict[str, torch.Tensor]) -> None:
    expected = weaver.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise ValueError(f"state_dict is missing keys {missing} (layout {weaver.config.layout!r})")
    unexpected = sorted(set(state_dict) - set(expected))
    if unexpected:
        raise ValueError(
            f"state_dict has unexpected keys {unexpected} (layout {weaver.config.layout!r})"
        )
    for key, want in expected.items():
        got = state_dict[key]
        if got.shape != want.shape:
            raise ValueError(
                f"state_dict[{key!r}] has shape {list(got.shape)}, expected {list(want.shape)}"
            )
        if not got.is_floating_point():
            raise ValueError(f"state_dict[{key!r}] must be a float tensor, got {got.dtype}")
