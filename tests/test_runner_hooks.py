"""Model-runner hooks that need no engine: which steps may replay CUDA graphs, which
engine's forwards see a tree step."""

from types import SimpleNamespace

import pytest

from vllm_tfm.vllm_glue import tree_step
from vllm_tfm.vllm_glue.v2.choice import select_model_runner
from vllm_tfm.vllm_glue.runner import wrap_determine_batch_execution_and_padding, wrap_init


def _dispatch(runner) -> bool:
    """The force_eager flag the wrapped vLLM method receives for ``runner``."""
    received = {}

    def original(self, num_tokens, **kwargs):
        received.update(kwargs)
        return "dispatched"

    wrapped = wrap_determine_batch_execution_and_padding(original)
    assert wrapped(runner, 65) == "dispatched"
    return received.get("force_eager", False)


# A tree step no graph holds: its trees are not all of the captured size (see
# tests/test_tree_graphs.py for the ones that replay graphs).
PARTIAL_TREES = SimpleNamespace(has_trees=True, only_tree_rows=False, void=None)


@pytest.mark.parametrize(
    "options, step, eager",
    [
        (object(), PARTIAL_TREES, True),  # a tree step no graph holds: eager
        (object(), SimpleNamespace(has_trees=False), False),  # only roots: graphs allowed
        (object(), None, False),  # a step with no spec metadata (prompts)
        (None, PARTIAL_TREES, False),  # an engine not running dflash_tfm
    ],
)
def test_tree_steps_no_graph_holds_are_forced_eager(options, step, eager):
    runner = SimpleNamespace(_tfm_options=options, _tfm_step=step,
                             _tfm_graphs=SimpleNamespace(num_nodes=65, steps={}),
                             parallel_config=SimpleNamespace(data_parallel_size=1))
    assert _dispatch(runner) is eager


def test_a_runner_without_plugin_state_is_untouched():
    assert _dispatch(SimpleNamespace()) is False


def _forward_context(static_forward_context: dict):
    """vLLM's forward context of an engine whose static forward context this is."""
    from vllm.forward_context import create_forward_context, override_forward_context

    config = SimpleNamespace(compilation_config=SimpleNamespace(
        fast_moe_cold_start=False, static_forward_context=static_forward_context))
    return override_forward_context(create_forward_context(None, config))


def test_a_tree_step_is_seen_by_its_own_engines_forwards_only():
    """Seen on the H200 when the step was one module global: a tree step whose forward
    raised stayed active, and the next engine of the process (vLLM's own dflash) ran the
    tree path while capturing its CUDA graphs. Each engine now has its own slot."""
    failed_engine, tree_engine, plain_engine = {}, {}, {}
    tree_step.install_step_slot(failed_engine).step = SimpleNamespace(has_trees=True)
    slot = tree_step.install_step_slot(tree_engine)
    with _forward_context(plain_engine):
        assert tree_step.active() is None
    with _forward_context(tree_engine):
        assert tree_step.active() is None
        step = SimpleNamespace(has_trees=True)
        slot.step = step
        assert tree_step.active() is step
    assert tree_step.active() is None  # outside any forward
    # A runner made anew for an engine replaces the slot a failed forward left filled.
    tree_step.install_step_slot(failed_engine)
    with _forward_context(failed_engine):
        assert tree_step.active() is None


def test_a_plain_runner_gets_no_slot():
    init = wrap_init(lambda self, vllm_config, device: None)
    context: dict = {}
    not_tree = SimpleNamespace(additional_config=None, speculative_config=None,
                               compilation_config=SimpleNamespace(static_forward_context=context))
    runner = SimpleNamespace()
    init(runner, not_tree, "cpu")
    assert runner._tfm_options is None and tree_step.STEP_SLOT_KEY not in context


def test_model_runner_v1_is_chosen_past_vllms_env_cache(monkeypatch):
    """An engine core that started earlier in this process left vLLM's env cache holding
    VLLM_USE_V2_MODEL_RUNNER=1: a dflash_tfm engine must still get V1."""
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    envs.enable_envs_cache()
    try:
        assert envs.VLLM_USE_V2_MODEL_RUNNER
        select_model_runner("v1")
        assert envs.VLLM_USE_V2_MODEL_RUNNER is False
    finally:
        envs.disable_envs_cache()


def test_every_listed_write_into_vllm_names_a_glue_function_that_exists():
    import importlib

    from vllm_tfm.vllm_glue.patches import VLLM_OBJECT_WRITES

    for write in VLLM_OBJECT_WRITES:
        module, function = write.writer.split(":")
        assert callable(getattr(importlib.import_module(module), function, None)), write
