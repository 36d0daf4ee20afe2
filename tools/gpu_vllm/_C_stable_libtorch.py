# Stand-in for the compiled vllm._C_stable_libtorch (pure Python, any vLLM the payload stages).
# vllm/platforms/cuda.py imports vllm._C_stable_libtorch at module level; without the real .so
# this module takes its place. It defines into torch.ops._C the op schemas listed in
# _C_stable_libtorch_schemas.txt beside it, which extract_schemas.py writes at payload build time
# from the real .so of the staged vLLM version (the schemas that its Python source names as
# torch.ops._C.X), so that import-time references like torch.ops._C.X.default resolve, and gives
# pure-torch kernels for the few ops called on the Triton/native path
# (silu_and_mul, rms_norm, fused_add_rms_norm, rotary_embedding).
# Ops that vLLM feature-detects with hasattr/getattr(torch.ops._C, "...") are deliberately NOT
# defined (extract_schemas.py leaves them out), so vLLM picks its Triton/native fallbacks.
import os

import torch
import torch.nn.functional as F

with open(os.path.join(os.path.dirname(__file__), "_C_stable_libtorch_schemas.txt")) as _f:
    _SCHEMAS = [line.rstrip("\n") for line in _f if line.strip()]

_lib = torch.library.Library("_C", "FRAGMENT")
DEFINED, FAILED = [], []
for _s in _SCHEMAS:
    try:
        _lib.define(_s)
        DEFINED.append(_s.split("(")[0])
    except Exception as _e:  # schema syntax unknown to this torch version
        FAILED.append((_s.split("(")[0], repr(_e)[:200]))


def _silu_and_mul(result, input):
    d = input.shape[-1] // 2
    result.copy_(F.silu(input[..., :d]) * input[..., d:])


def _rms_norm(result, input, weight, epsilon):
    x = input.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
    if weight is not None:
        w = weight.float()
        if w.dim() > 1 and input.dim() > w.dim():  # grouped weights (DFlash) index outer dims
            w = w.view(*w.shape[:-1], *([1] * (input.dim() - w.dim())), w.shape[-1])
        y = y * w
    result.copy_(y.to(result.dtype))


def _fused_add_rms_norm(input, residual, weight, epsilon):
    residual.add_(input)
    _rms_norm(input, residual, weight, epsilon)


def _rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox,
                      rope_dim_offset=0, inverse=False):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    if rope_dim_offset != 0 or inverse:
        raise NotImplementedError("python rotary_embedding stand-in: plain case only")
    q, k = RotaryEmbedding.forward_static(positions, query, key, head_size,
                                          cos_sin_cache.shape[-1], cos_sin_cache, is_neox)
    query.copy_(q.view_as(query))
    if key is not None:
        key.copy_(k.view_as(key))


for _n, _f in [("silu_and_mul", _silu_and_mul), ("rms_norm", _rms_norm),
               ("fused_add_rms_norm", _fused_add_rms_norm),
               ("rotary_embedding", _rotary_embedding)]:
    if _n in DEFINED:
        _lib.impl(_n, _f, "CompositeExplicitAutograd")
