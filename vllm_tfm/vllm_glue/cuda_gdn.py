"""GDN layers over a draft tree on CUDA: ``QwenGatedDeltaNetAttention._forward_core``.

vLLM's CUDA path runs the spec rows through ``causal_conv1d_update`` and
``fused_sigmoid_gating_delta_rule_update`` (one state per draft token). During a
tree step the spec rows go through :func:`.gdn.tree_gdn_core` instead, and
prompt rows of the same batch through vLLM's own path, which is handed a copy
of the layer's metadata with the spec part removed.

Cache views (vLLM 0.32, mamba cache mode "none"):
- conv state: logically [slots, dim, W - 1] (a dflash_tfm engine's has no draft
  columns, gdn.wrap_gdn_layer_init; vLLM's chain keeps W - 1 + num_spec). vLLM's
  prefill kernel (``causal_conv1d_fn``) leaves the committed inputs in columns
  0 .. W-2, oldest to newest, and reads them back from there; the tree conv reads
  and commits that same window (``[:, :, :W-1]``).
- SSM state: [slots, HV, V, K]; the tree kernels take [slots, HV, K, V], so they
  get the transposed view of the same memory.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from vllm_tfm.vllm_glue import tree_step
from vllm_tfm.vllm_glue.gdn import draftless_conv_state, outside_tree_step, tree_gdn_core


def _layer_metadata(layer):
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    return metadata.get(layer.prefix) if isinstance(metadata, dict) else None


def _state_views(layer, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv [slots, C, W-1] committed window, ssm [slots, HV, K, V]) views."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv_cache, ssm_cache = layer.kv_cache[0], layer.kv_cache[1]
    conv_state = conv_cache if is_conv_state_dim_first() else conv_cache.transpose(-1, -2)
    return conv_state[:, :, : width - 1], ssm_cache.transpose(-1, -2)


def _forward_prompt_rows(original, layer, metadata, mixed_qkv, b, a, core_attn_out) -> None:
    """vLLM's own path over the non-spec rows (prompt chunks) of a mixed batch.

    When spec rows exist, vLLM's metadata builder counts every non-spec row as
    a prefill and already built the prefill fields (state indices, chunk
    tables, conv metadata) for the non-spec subset alone: with the spec mask
    cleared, the original runs exactly its prefill branch over those rows.
    """
    from vllm.forward_context import get_forward_context

    rows = metadata.non_spec_token_indx
    prompt_only = dataclasses.replace(
        metadata, spec_sequence_masks=None, num_actual_tokens=int(rows.numel())
    )
    out = core_attn_out.new_zeros(rows.numel(), *core_attn_out.shape[1:])
    by_layer = get_forward_context().attn_metadata
    by_layer[layer.prefix] = prompt_only
    try:
        original(layer, mixed_qkv.index_select(0, rows), b.index_select(0, rows),
                 a.index_select(0, rows), out)
    finally:
        by_layer[layer.prefix] = metadata
    core_attn_out.index_copy_(0, rows, out)


def wrap_gdn_forward_core(original):
    @functools.wraps(original)
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        step = tree_step.active()
        if step is None and not draftless_conv_state(self):  # not a dflash_tfm engine
            return original(self, mixed_qkv, b, a, core_attn_out)
        metadata = _layer_metadata(self)
        if metadata is None or metadata.spec_sequence_masks is None:
            return original(self, mixed_qkv, b, a, core_attn_out)
        if step is None:
            raise outside_tree_step(self)
        if metadata.num_decodes > 0:
            raise RuntimeError(
                "dflash_tfm: vLLM's GDN metadata mixes plain decodes with spec decodes "
                f"({metadata.num_decodes} decodes), which its builder rules out"
            )
        num_spec = metadata.num_spec_decodes
        if metadata.num_prefills == 0:
            spec_rows = None
            num_tokens = metadata.num_actual_tokens
            spec_qkv, spec_b, spec_a = mixed_qkv[:num_tokens], b[:num_tokens], a[:num_tokens]
        else:
            _forward_prompt_rows(original, self, metadata, mixed_qkv, b, a, core_attn_out)
            spec_rows = metadata.spec_token_indx
            spec_qkv = mixed_qkv.index_select(0, spec_rows)
            spec_b, spec_a = b.index_select(0, spec_rows), a.index_select(0, spec_rows)
        weight = self.conv1d.weight
        width = weight.shape[-1]
        conv_state, ssm_state = _state_views(self, width)
        # Without prompt rows the spec tokens are the first rows: their outputs go straight
        # into vLLM's buffer (a dense step's verify writes them there).
        out = tree_gdn_core(
            self, step, step.spec_nodes(metadata.spec_sequence_masks_cpu),
            spec_qkv, spec_b, spec_a,
            weight.view(weight.shape[0], width), conv_state, ssm_state,
            step.state_slots(metadata.spec_state_indices_tensor, num_spec),
            out=core_attn_out[: spec_qkv.shape[0]] if spec_rows is None else None,
        )
        if spec_rows is not None:
            core_attn_out.index_copy_(0, spec_rows, out.to(core_attn_out.dtype))

    return _forward_core


def wrap_gdn_init(original):
    """With dflash_tfm on, every GDN layer takes the ``_forward_core`` path: the
    fused CUDA spec-decode kernel (``VLLM_GDN_DECODE_KERNEL=cuda``) would run
    the chain recurrence on the tree's rows."""
    from vllm_tfm.vllm_glue.config import tfm_options

    @functools.wraps(original)
    def __init__(self, config, vllm_config, *args, **kwargs):
        original(self, config, vllm_config, *args, **kwargs)
        if tfm_options(vllm_config) is not None:
            self.enable_fused_gdn_spec_decode = False
            self.gdn_decode_kernel = "triton"

    return __init__
