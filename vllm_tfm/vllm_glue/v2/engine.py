"""What a V2 dflash_tfm engine's speculator and model state share.

vLLM builds the speculator (runner ``__init__``) before the model state (``load_model``)
and hands neither to the other: the speculator files a :class:`TreeEngine` in the
engine's static forward context (a per-engine dict, like ``tree_step.STEP_SLOT_KEY``),
where the model state finds it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from vllm_tfm.vllm_glue.tree_step import StepSlot, TreeStep

ENGINE_KEY = "vllm_tfm.v2_engine"


@dataclasses.dataclass
class TreeEngine:
    """One engine's trees by slot, its layers' step slot and the step being scored."""

    trees: Any  # trees.SlotTrees
    slot: StepSlot  # what the layers read during the target forward
    draft_layer_names: set[str]  # the drafter's attention layers (no tree commit)
    verify: str  # the ``verify`` option: how the model state verifies sampled requests
    # The step scored by the last target forward, from its prepare_attn until the
    # speculator has read its accepted paths (context order, bonus rows).
    step: TreeStep | None = None
    # V2's per-slot temperatures on the host (SamplingStates.temperature.np, filed by the
    # model state's custom_sampler): which requests' next trees are sampled.
    temperature: np.ndarray | None = None


def install_engine(static_forward_context: dict, engine: TreeEngine) -> None:
    static_forward_context[ENGINE_KEY] = engine


def find_engine(static_forward_context: dict) -> TreeEngine:
    engine = static_forward_context.get(ENGINE_KEY)
    if engine is None:
        raise RuntimeError("dflash_tfm on model runner V2: the tree model state was built "
                           "without the tree speculator (init_speculator was not patched)")
    return engine
