"""Model-runner hooks that need no engine: which steps may replay CUDA graphs, what a new
runner inherits."""

from types import SimpleNamespace

import pytest

from vllm_tfm.vllm_glue import tree_step
from vllm_tfm.vllm_glue.config import select_model_runner_v1
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


@pytest.mark.parametrize(
    "options, step, eager",
    [
        (object(), SimpleNamespace(has_trees=True), True),  # a tree step: eager
        (object(), SimpleNamespace(has_trees=False), False),  # only roots: graphs allowed
        (object(), None, False),  # a step with no spec metadata (prompts)
        (None, SimpleNamespace(has_trees=True), False),  # an engine not running dflash_tfm
    ],
)
def test_only_tree_steps_are_forced_eager(options, step, eager):
    runner = SimpleNamespace(_tfm_options=options, _tfm_step=step)
    assert _dispatch(runner) is eager


def test_a_runner_without_plugin_state_is_untouched():
    assert _dispatch(SimpleNamespace()) is False


def test_a_new_runner_drops_the_tree_step_a_failed_forward_left_active():
    """Seen on the H200: a tree step whose forward raised stayed active, and the next engine
    of the process (vLLM's own dflash) ran the tree path while capturing its CUDA graphs."""
    tree_step.activate(SimpleNamespace(has_trees=True))
    init = wrap_init(lambda self, vllm_config, device: None)
    not_tree = SimpleNamespace(additional_config=None, speculative_config=None)
    init(SimpleNamespace(), not_tree, "cpu")
    assert tree_step.active() is None


def test_model_runner_v1_is_chosen_past_vllms_env_cache(monkeypatch):
    """An engine core that started earlier in this process left vLLM's env cache holding
    VLLM_USE_V2_MODEL_RUNNER=1: a dflash_tfm engine must still get V1."""
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    envs.enable_envs_cache()
    try:
        assert envs.VLLM_USE_V2_MODEL_RUNNER
        select_model_runner_v1()
        assert envs.VLLM_USE_V2_MODEL_RUNNER is False
    finally:
        envs.disable_envs_cache()
