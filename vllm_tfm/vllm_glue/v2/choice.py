"""Which model runner a dflash_tfm engine takes: decided here, in one place."""

from __future__ import annotations

import os

RUNNERS = ("v1", "v2")
# The runner dflash_tfm takes where V2 can run (CUDA, vLLM >= 0.33, TP 1) and the user chose
# none: vLLM 0.33's GPU default. The V2 tree path applies V2's sampling per tree node
# (v2/node_processing.py) and refuses by name what it cannot (structured outputs, thinking
# budgets, custom logits processors: VLLM_USE_V2_MODEL_RUNNER=0 serves them on V1).
DEFAULT_TREE_RUNNER = "v2"
ENV = "VLLM_USE_V2_MODEL_RUNNER"
_ENV_VALUES = {"0": "v1", "1": "v2"}
V2_MIN_VLLM = (0, 33)


def v2_unavailable_reason(on_cuda: bool, vllm_version: tuple[int, int],
                          tensor_parallel_size: int) -> str | None:
    """Why the V2 tree path cannot run here (None: it can)."""
    if not on_cuda:
        return "model runner V2 runs on CUDA only"
    if vllm_version < V2_MIN_VLLM:
        return (f"the V2 tree path needs vLLM >= {'.'.join(map(str, V2_MIN_VLLM))}, found "
                f"{'.'.join(map(str, vllm_version))}")
    if tensor_parallel_size != 1:
        return (f"the V2 tree path runs with tensor_parallel_size 1, got "
                f"{tensor_parallel_size}")
    return None


def tree_runner(env_value: str | None, on_cuda: bool, vllm_version: tuple[int, int],
                tensor_parallel_size: int) -> str:
    """"v1" or "v2" for a dflash_tfm engine: ``VLLM_USE_V2_MODEL_RUNNER`` ("0", "1" or
    unset) where the user set it, else ``DEFAULT_TREE_RUNNER`` where V2 can run, else V1."""
    reason = v2_unavailable_reason(on_cuda, vllm_version, tensor_parallel_size)
    if env_value in (None, ""):
        return DEFAULT_TREE_RUNNER if reason is None else "v1"
    if env_value not in _ENV_VALUES:
        raise ValueError(f"{ENV} must be one of {sorted(_ENV_VALUES)} (or unset) with "
                         f"speculative method 'dflash_tfm', got {env_value!r}")
    runner = _ENV_VALUES[env_value]
    if runner == "v2" and reason is not None:
        raise ValueError(f"{ENV}=1 with speculative method 'dflash_tfm': {reason}")
    return runner


def select_model_runner(runner: str) -> None:
    """Make this process's next engine take model runner ``runner``.

    vLLM reads ``VLLM_USE_V2_MODEL_RUNNER`` through ``vllm.envs``, which caches every
    variable once an engine core has started in the process: drop that cache (vLLM's own
    reset; the next engine core caches again) so an earlier engine's value is not reused.
    """
    import vllm.envs as envs

    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {list(RUNNERS)}, got {runner!r}")
    os.environ[ENV] = "1" if runner == "v2" else "0"
    envs.disable_envs_cache()

