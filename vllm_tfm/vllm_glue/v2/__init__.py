"""dflash_tfm on vLLM 0.33's model runner V2 (CUDA, tensor_parallel_size 1).

V2 has no runner patches to hang a tree on; it has seams (tools/gpu_vllm/V2_SEAMS.md):

- ``choice.py``: which model runner a dflash_tfm engine takes (one constant to flip);
- ``speculator.py``: :class:`TreeSpeculator`, vLLM's DFlash speculator with a block of
  the draft depth whose graphed forward leaves candidate pools in persistent buffers,
  growing trees from them and handing vLLM [R, budget] drafts (-1 past the step's k,
  the budget rule as vLLM's batch-size schedule: ``config.batch_size_budgets``); the
  trees are kept per request slot (:class:`.trees.SlotTrees`);
- ``model_state.py``: :class:`TreeModelState` (a MambaHybridModelState): builds each
  step's tree before the forward (positions in place; under FULL graphs the trees are
  copied into the captured step's buffers, V1's ``tree_graphs`` scheme), verifies
  through ``custom_sampler``, commits the accepted path and pins the GDN offset to 1;
- ``hooks.py``: the two patches V2 needs (``init_speculator``, ``resolve_model_state_cls``:
  vLLM has no registry for either), listed in ``patches.py``.

The layers are V1's: the TRITON_ATTN and GDN patches read the step from the engine's
StepSlot (``tree_step.active``), on either runner.
"""
