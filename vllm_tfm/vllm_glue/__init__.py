"""vLLM glue for ``dflash_tfm``: the plugin entry point and every patch it applies.

``register()`` is vLLM's ``vllm.general_plugins`` entry point: it runs in every
vLLM process (front end, engine core, workers) and is idempotent.
"""

from vllm_tfm.vllm_glue.patches import (
    PATCHES,
    applicable_patches,
    apply_patches,
    check_vllm_version,
)


def register() -> None:
    check_vllm_version()
    apply_patches()


__all__ = ["PATCHES", "applicable_patches", "apply_patches", "check_vllm_version", "register"]
