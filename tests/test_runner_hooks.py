"""Model-runner hooks that need no engine: which steps may replay CUDA graphs."""

from types import SimpleNamespace

import pytest

from vllm_tfm.vllm_glue.runner import wrap_determine_batch_execution_and_padding


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
