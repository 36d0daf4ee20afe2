"""Model runner V2's FULL decode graphs cut to those the budget schedule replays
(vllm_glue/v2/graph_pruning.py): vLLM's own ``_init_candidates`` and ``dispatch`` on a
graph manager of a dflash_tfm engine's settings, with and without the patch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config import CUDAGraphMode
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

from vllm_tfm.options import batch_size_schedule, default_budget_table
from vllm_tfm.vllm_glue.v2 import graph_pruning

# vLLM's default capture sizes: 1, 2, 4, steps of 8 to 256, then of 16 to 512.
DEFAULT_SIZES = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]


def _manager(schedule, max_reqs: int, budget: int, sizes=DEFAULT_SIZES) -> CudaGraphManager:
    """A manager with what ``_init_candidates`` and ``dispatch`` read (FULL_DECODE_ONLY,
    no LoRA, no microbatching), candidates not yet built."""
    manager = CudaGraphManager.__new__(CudaGraphManager)
    speculative = SimpleNamespace(num_speculative_tokens_per_batch_size=schedule,
                                  uses_dynamic_speculative_decoding=lambda: schedule is not None)
    manager.vllm_config = SimpleNamespace(speculative_config=speculative,
                                          num_speculative_tokens=budget,
                                          cache_config=SimpleNamespace(use_kda_recoverssm=False))
    manager.compilation_config = SimpleNamespace(cudagraph_capture_sizes=list(sizes),
                                                 max_cudagraph_capture_size=max(sizes))
    manager.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    manager.max_num_reqs, manager.decode_query_len = max_reqs, 1 + budget
    manager.varlen_decode, manager.lora_capture_cases, manager.ubatch_runner = False, [0], None
    manager._lora_dispatch_map, manager._max_lora_case = {}, 0
    manager._capture_descs, manager._candidates = {}, {}
    manager._graphs_captured = True
    return manager


def _both(monkeypatch, schedule, max_reqs: int, budget: int, tfm: bool = True):
    """(vLLM's manager, the patched one) of the same settings."""
    monkeypatch.setattr(graph_pruning, "tfm_options", lambda config: object() if tfm else None)
    plain, pruned = (_manager(schedule, max_reqs, budget) for _ in range(2))
    CudaGraphManager._init_candidates(plain)
    graph_pruning.wrap_init_candidates(CudaGraphManager._init_candidates)(pruned)
    return plain, pruned


def _captured(manager) -> list:
    return [desc for descs in manager._capture_descs.values() for desc in descs]


@pytest.mark.parametrize("budget, max_reqs", [(64, 8), (64, 256), (32, 64), (128, 32)])
def test_every_batch_dispatches_as_before_and_the_dropped_graphs_were_never_replayed(
        monkeypatch, budget, max_reqs):
    schedule = batch_size_schedule(default_budget_table(budget), budget)
    plain, pruned = _both(monkeypatch, schedule, max_reqs, budget)
    lookup = build_dynamic_sd_schedule_lookup(schedule, max_reqs, budget)
    replayed = set()
    for n in range(1, max_reqs + 1):
        query_len = 1 + lookup[n]
        asked = (n, n * query_len, query_len, 0)
        before = plain.dispatch(*asked)
        assert pruned.dispatch(*asked) == before, (n, query_len)
        replayed.add(before)
    dropped = set(_captured(plain)) - set(_captured(pruned))
    assert dropped and not dropped & replayed
    assert set(_captured(pruned)) < set(_captured(plain))
    # Of the whole budget's graphs, one per batch size that drafts it is left.
    full = [n for n in range(1, max_reqs + 1) if lookup[n] == budget]
    whole = [d.num_reqs for d in _captured(pruned) if d.uniform_token_count == 1 + budget]
    assert sorted(whole) == full
    assert all(pruned._candidates.values())


def test_at_the_benchmarks_batch_8_the_rule_engine_keeps_a_graph_per_batch_size(monkeypatch):
    budget = 64
    schedule = batch_size_schedule(default_budget_table(budget), budget)
    plain, pruned = _both(monkeypatch, schedule, 8, budget)
    lookup = build_dynamic_sd_schedule_lookup(schedule, 8, budget)
    kept = sorted((d.num_reqs, d.uniform_token_count) for d in _captured(pruned))
    assert kept == [(n, 1 + lookup[n]) for n in range(1, 9)]
    assert len(_captured(plain)) > 2 * len(kept)


@pytest.mark.parametrize("tfm, schedule", [(False, [(1, 8, 64)]), (True, None)])
def test_other_engines_and_a_fixed_budget_capture_what_vllm_captures(monkeypatch, tfm, schedule):
    plain, patched = _both(monkeypatch, schedule, 16, 64, tfm=tfm)
    assert patched._capture_descs == plain._capture_descs
    assert patched._candidates == plain._candidates
