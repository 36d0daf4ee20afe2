"""Tree verification of a V2 batch, in the shape of V2's rejection sampler.

V2 samples every request of a batch by slot (``idx_mapping``); its sampling states keep a
temperature and a seed per slot. Every node row first goes through V2's request-level
processing over that node's own path (``node_processing``: logit bias, allowed tokens,
min_tokens, penalties, bad words, temperature, min_p, top-k / top-p); then the verifiers the
``verify`` option picks, as on model runner V1 (``vllm_glue/verify.py``): greedy requests the
greedy verifier, sampled requests whose tree was sampled traversal, the other sampled
requests target-only verification of their deterministic trees (lossless for any tree), all
chosen from host state; none reads anything back from the device. Logprobs follow the
accepted path in V2's chain layout. What has no tree form here is refused per request on V2
(``wrap_validate_params``): structured outputs (V2 masks a chain's rows with one grammar
state per offset) and thinking budgets.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_tfm.drafting.tree import DraftTree
from vllm_tfm.drafting.verifiers import VerifyResult
from vllm_tfm.vllm_glue.verify import verify_option, verify_trees

_GREEDY_TEMPERATURE_EPS = 1e-5
# Odd 64-bit multiplier: a request's seed and its root position make its step's seed.
_SEED_STRIDE = 0x9E3779B97F4A7C15 - (1 << 64)


def step_seeds(request_seeds: torch.Tensor, prefix_lens: torch.Tensor) -> torch.Tensor:
    """[R] int64: a fresh seed per request and step, reproducible from the request's seed."""
    return request_seeds.long() + prefix_lens.long() * _SEED_STRIDE


def verify_batch(tree: DraftTree, processed: torch.Tensor, temperature: np.ndarray,
                 sampled_tree: np.ndarray, seeds: torch.Tensor, verify: str,
                 scratch: bool = False) -> VerifyResult:
    """Accept one path per request of ``tree`` ([R, N]) against ``processed`` [R, N, V], the
    node logits after V2's sampling processing (temperature included; ``temperature`` [R]
    on the host, V2's ``SamplingStates.temperature.np`` of the batch's slots, 0 = greedy:
    the argmax of the processed row, as V2's chain verifier takes it). ``sampled_tree`` [R]
    on the host: the request's tree was sampled (``SlotTrees.sampled``); ``verify``: the
    option; ``scratch``: ``processed`` is the caller's float32 copy, read no more after
    (``verify_trees``)."""
    greedy, mode = verify_option(verify, temperature < _GREEDY_TEMPERATURE_EPS)
    return verify_trees(tree, processed, processed, greedy, sampled_tree, seeds, mode,
                        scratch=scratch)


def sampled_tokens(result: VerifyResult, width: int) -> torch.Tensor:
    """[R, width] int64: the accepted drafts then the bonus token, -1 after."""
    tokens = result.output_tokens[:, :width].long()
    return torch.nn.functional.pad(tokens, (0, width - tokens.shape[1]), value=-1)


def path_logprobs(nodes: torch.Tensor, path: torch.Tensor, sampled: torch.Tensor,
                  num_sampled: torch.Tensor, cu_num_logits: torch.Tensor,
                  cu_num_logits_np: np.ndarray, num_logprobs: int, logits_mode: bool):
    """V2's logprobs of a tree step, in the layout its chain rejection sampler returns: row
    cu_num_logits[r] + k scores request r's k-th output token (``sampled`` [R, W]) under the
    distribution of its k-th path node (``nodes`` [R, W, V], ``path`` [R, P] node indices,
    -1 past the path); rows past ``num_sampled[r]`` are placeholders V2 drops."""
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

    num_reqs, width = nodes.shape[:2]
    num_logits = int(cu_num_logits_np[-1])
    row = torch.arange(num_logits, device=nodes.device)
    request = torch.searchsorted(cu_num_logits[1:].long(), row, right=True)
    offset = (row - cu_num_logits[request].long()).clamp(max=width - 1)
    node_of = torch.zeros(num_reqs, width, dtype=torch.long, device=nodes.device)
    depth = min(width, path.shape[1])
    node_of[:, :depth] = path[:, :depth].long().clamp(min=0)
    # float32 after the gather: the rows scored, not every node row.
    logits = nodes.flatten(0, 1)[request * width + node_of[request, offset]].float()
    tokens = sampled[request, offset].clamp(min=0)
    tokens = torch.where(offset < num_sampled.long()[request], tokens, 0)
    expanded = num_logits != num_reqs
    return compute_topk_scores(
        logits, num_logprobs, tokens,
        cu_num_logits_np.tolist() if expanded else None, logits_mode=logits_mode)


# SamplingParams fields the V2 tree path does not apply per node, with their defaults.
# (vLLM itself refuses min_p and logit_bias with any speculative method.)
_CHAIN_ONLY_DEFAULTS = (("structured_outputs", None), ("thinking_token_budget", None))


def refused_sampling_field(params) -> str | None:
    """The first SamplingParams field of ``params`` the V2 tree path refuses, with its
    value (None: every field is supported)."""
    for name, default in _CHAIN_ONLY_DEFAULTS:
        value = getattr(params, name, default)
        if value is not default:
            return f"{name}={value!r}"
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
