"""Tree verification of a V2 batch, in the shape of V2's rejection sampler.

V2 samples every request of a batch by slot (``idx_mapping``); its sampling states keep a
temperature and a seed per slot. Greedy requests take the greedy verifier; sampled ones
target-only verification of their deterministic trees at their temperature (lossless for
any tree). Request-level processing V2 applies along one chain (penalties, bad words,
min_tokens, allowed tokens, top-k / top-p, logprobs, structured outputs) is not applied
to tree nodes: the engine refuses those requests on V2 (``wrap_validate_params``).
"""

from __future__ import annotations

import torch

from vllm_tfm.drafting.tree import DraftTree
from vllm_tfm.drafting.verifiers import VerifyResult
from vllm_tfm.vllm_glue.verify import verify_trees

_GREEDY_TEMPERATURE_EPS = 1e-5
# Odd 64-bit multiplier: a request's seed and its root position make its step's seed.
_SEED_STRIDE = 0x9E3779B97F4A7C15 - (1 << 64)


def node_logits(logits: torch.Tensor, cu_num_logits: torch.Tensor, num_nodes: torch.Tensor,
                width: int) -> torch.Tensor:
    """[R, width, V]: request r's logits rows cu_num_logits[r + 1] - n_r + j, zeros past
    its n_r nodes (a prompt chunk's one row is its root)."""
    ends = cu_num_logits[1:].long()
    count = num_nodes.long()
    node = torch.arange(width, device=logits.device)
    rows = (ends - count).view(-1, 1) + node
    valid = node < count.view(-1, 1)
    return torch.where(valid[..., None], logits[torch.where(valid, rows, 0)], 0.0)


def step_seeds(request_seeds: torch.Tensor, prefix_lens: torch.Tensor) -> torch.Tensor:
    """[R] int64: a fresh seed per request and step, reproducible from the request's seed."""
    return request_seeds.long() + prefix_lens.long() * _SEED_STRIDE


def verify_batch(tree: DraftTree, logits: torch.Tensor, temperature: torch.Tensor,
                 seeds: torch.Tensor) -> VerifyResult:
    """Accept one path per request of ``tree`` ([R, N]) against ``logits`` [R, N, V]
    (temperature [R], 0 = greedy)."""
    is_greedy = temperature < _GREEDY_TEMPERATURE_EPS
    scale = torch.where(is_greedy, 1.0, temperature.float()).view(-1, 1, 1)
    no_sampled_trees = torch.zeros_like(is_greedy, device="cpu")
    return verify_trees(tree, logits, logits / scale, is_greedy, no_sampled_trees, seeds,
                        "target_only")


def sampled_tokens(result: VerifyResult, width: int) -> torch.Tensor:
    """[R, width] int64: the accepted drafts then the bonus token, -1 after."""
    out = torch.full((result.output_tokens.shape[0], width), -1, dtype=torch.int64,
                     device=result.output_tokens.device)
    tokens = result.output_tokens[:, :width]
    out[:, : tokens.shape[1]] = tokens
    return out


# SamplingParams fields whose non-default values the V2 tree path does not apply per node.
_CHAIN_ONLY_DEFAULTS = (
    ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
    ("min_p", 0.0), ("top_p", 1.0), ("min_tokens", 0), ("logprobs", None),
    ("prompt_logprobs", None), ("bad_words", None), ("allowed_token_ids", None),
    ("logit_bias", None), ("structured_outputs", None),
)


def refused_sampling_field(params) -> str | None:
    """The first SamplingParams field of ``params`` the V2 tree path refuses, with its
    value (None: every field is supported)."""
    for name, default in _CHAIN_ONLY_DEFAULTS:
        value = getattr(params, name, default)
        if value not in (default, None) and value != [] and value != {}:
            return f"{name}={value!r}"
    top_k = getattr(params, "top_k", None)
    if top_k not in (None, 0, -1):
        return f"top_k={top_k!r}"
    return None


def wrap_validate_params(original):
    """vLLM's request validation, refusing on a V2 dflash_tfm engine what
    ``refused_sampling_field`` names (a 400 for that request, before it is scheduled)."""
    import functools

    from vllm.sampling_params import SamplingParams

    from vllm_tfm.vllm_glue.config import tfm_options

    @functools.wraps(original)
    def _validate_params(self, params, *args, **kwargs):
        result = original(self, params, *args, **kwargs)
        config = self.vllm_config
        if (isinstance(params, SamplingParams) and tfm_options(config) is not None
                and config.use_v2_model_runner):
            refused = refused_sampling_field(params)
            if refused is not None:
                raise ValueError(
                    f"dflash_tfm on model runner V2 does not apply {refused} to tree "
                    "nodes; leave it at its default or run model runner V1 "
                    "(VLLM_USE_V2_MODEL_RUNNER=0)")
        return result

    return _validate_params
