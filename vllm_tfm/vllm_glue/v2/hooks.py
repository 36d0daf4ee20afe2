"""The two places model runner V2 picks its per-method classes, for dflash_tfm.

V2 has no registry for speculators or model states: ``init_speculator`` chooses by method
name (imported by name into ``model_runner``) and ``resolve_model_state_cls`` by model
kind. Both patches (``patches.py``) leave every other engine as vLLM builds it.
"""

from __future__ import annotations

import functools

from vllm_tfm.vllm_glue.config import tfm_options


def wrap_init_speculator(original):
    @functools.wraps(original)
    def init_speculator(vllm_config, device, *args, **kwargs):
        options = tfm_options(vllm_config)
        if options is None:
            return original(vllm_config, device, *args, **kwargs)
        from vllm_tfm.vllm_glue.v2.speculator import TreeSpeculator

        return TreeSpeculator(vllm_config, device, options)

    return init_speculator


def wrap_resolve_model_state_cls(original):
    @functools.wraps(original)
    def resolve_model_state_cls(vllm_config, model):
        chosen = original(vllm_config, model)
        if tfm_options(vllm_config) is None:
            return chosen
        from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

        from vllm_tfm.vllm_glue.v2.model_state import TreeModelState

        if chosen is not MambaHybridModelState:
            raise ValueError(
                "dflash_tfm on model runner V2 runs hybrid (GDN + attention) targets, whose "
                f"model state is MambaHybridModelState; this target's is {chosen.__name__} "
                "(run it on model runner V1: VLLM_USE_V2_MODEL_RUNNER=0)")
        return TreeModelState

    return resolve_model_state_cls
