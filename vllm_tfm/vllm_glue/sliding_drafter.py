"""DFlash drafters whose layers mix sliding-window and full attention, on model runner V1.

vLLM 0.32 and 0.33 build such drafters on model runner V2 only: V2 gives every KV-cache group
its own block table and attention metadata, while V1's DFlash proposer keeps one group for all
draft layers and one causality for all of them. ``qwen3_dflash._resolve_layer_attention``
therefore refuses a mixed drafter when V1 runs (NotImplementedError, "relaunch with
VLLM_USE_V2_MODEL_RUNNER=1"), and V1 is the only runner on CPU. Engines running dflash_tfm get
what V1 lacks, in four places:

- the V1 config check lets the mixed drafter through;
- each layer is resolved as vLLM resolves it (window, causality), without the refusal;
- the drafter's sliding-window layers are allocated as full-attention layers that keep their
  window (``FullAttentionSpec.sliding_window``, vLLM's own promotion for engines without the
  hybrid KV-cache manager): every draft layer lands in one KV-cache group, and the attention
  kernels still attend within the window;
- each draft layer gets attention metadata of its own causality (by default vLLM makes the
  sliding-window layers of a mixed drafter causal and the others not).

The cost is KV memory: the drafter's windowed layers keep blocks for the whole context.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

from vllm_tfm.vllm_glue.config import ADDITIONAL_CONFIG_KEY, tfm_options

SLIDING = "sliding_attention"


def mixes_sliding_and_full(config) -> bool:
    """Whether a DFlash drafter's ``layer_types`` mix sliding-window and full attention."""
    layer_types = getattr(config, "layer_types", None) or []
    sliding = sum(kind == SLIDING for kind in layer_types)
    return 0 < sliding < len(layer_types)


def single_type_view(config, layer_idx: int):
    """A shallow copy of ``config`` in which every layer has layer ``layer_idx``'s type.

    vLLM resolves a layer's window and causality from its own entry of ``layer_types``
    once the drafter has any sliding layer; in a single-type drafter of the layer's own
    type it resolves them the same way, except that ``dflash_config.use_swa`` would make a
    full-attention layer sliding, so the view of a full layer drops it.
    """
    view = copy.copy(config)
    kind = config.layer_types[layer_idx]
    view.layer_types = [kind] * len(config.layer_types)
    if kind != SLIDING:
        dflash_config = dict(getattr(config, "dflash_config", None) or {})
        dflash_config.pop("use_swa", None)
        view.dflash_config = dflash_config
    return view


def wrap_dflash_needs_multi_kv_group(original):
    """``VllmConfig._dflash_needs_multi_kv_group``, which refuses a mixed drafter on V1,
    answers False for dflash_tfm: the patches here give it the one group V1 reads.

    Keyed on our options in ``additional_config``, which the first validation (inside
    ``create_engine_config``, before the SpeculativeConfig carries our marker) already
    sees. Options written there by hand on vLLM's own ``dflash`` gain nothing: the layer
    resolution below still refuses that engine's mixed drafter.
    """

    @functools.wraps(original)
    def _dflash_needs_multi_kv_group(self) -> bool:
        if ADDITIONAL_CONFIG_KEY in (self.additional_config or {}):
            return False
        return original(self)

    return _dflash_needs_multi_kv_group


def wrap_resolve_layer_attention(original):
    @functools.wraps(original)
    def _resolve_layer_attention(config, layer_idx: int):
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
        if (
            vllm_config is None
            or tfm_options(vllm_config) is None
            or not mixes_sliding_and_full(config)
        ):
            return original(config, layer_idx)
        return original(single_type_view(config, layer_idx), layer_idx)

    return _resolve_layer_attention


def _unify_hybrid_kv_cache_specs():
    try:  # vLLM 0.33 moved KV-cache planning out of kv_cache_utils
        from vllm.v1.core.kv_cache_planning import unify_hybrid_kv_cache_specs
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import unify_hybrid_kv_cache_specs
    return unify_hybrid_kv_cache_specs


def wrap_get_kv_cache_spec(original):
    @functools.wraps(original)
    def get_kv_cache_spec(self):
        specs = original(self)
        if getattr(self, "_tfm_options", None) is None:
            return specs
        draft_layers = getattr(self.drafter, "_draft_attn_layer_names", None) or ()
        draft_specs = {name: specs[name] for name in draft_layers if name in specs}
        # In place: the windowed draft layers become FullAttentionSpec with their window
        # and the full layers' block size, when the drafter mixes both (else unchanged).
        _unify_hybrid_kv_cache_specs()(draft_specs)
        return {**specs, **draft_specs}

    return get_kv_cache_spec


def causal_draft_layers(model) -> frozenset[str]:
    """Names of the drafter's attention layers that attend causally."""
    return frozenset(
        name for name, causal in zip(model.get_draft_kv_cache_layer_names(),
                                     model.get_draft_attn_causal())
        if causal
    )


def wrap_build_per_group_and_layer_attn_metadata(original):
    """The draft layers' metadata, built with the drafter-wide causality (non-causal as
    soon as one layer is), with the causal layers' metadata rebuilt causal."""

    @functools.wraps(original)
    def build_per_group_and_layer_attn_metadata(self, common_attn_metadata, draft_index=0):
        from vllm_tfm.vllm_glue.proposer import TreeProposer

        per_group, per_layer = original(self, common_attn_metadata, draft_index)
        if not isinstance(self, TreeProposer) or self.dflash_causal:
            return per_group, per_layer
        causal_layers = causal_draft_layers(self.model)
        if not causal_layers:
            return per_group, per_layer
        causal = dataclasses.replace(common_attn_metadata, causal=True)
        per_layer = dict(per_layer)
        for group in self.draft_attn_groups:
            names = [name for name in group.layer_names if name in causal_layers]
            if names:
                metadata = group.build_metadata_for_drafting(common_attn_metadata=causal,
                                                             draft_index=draft_index)
                per_layer.update(dict.fromkeys(names, metadata))
        return per_group, per_layer

    return build_per_group_and_layer_attn_metadata
