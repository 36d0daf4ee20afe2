"""Model runner V2's FULL decode graphs, cut to those a dflash_tfm engine replays.

A dflash_tfm engine on V2 always drafts by a batch-size schedule
(``num_speculative_tokens_per_batch_size``: its budget rule). For such a schedule vLLM's
``CudaGraphManager._init_candidates`` captures a uniform-decode graph of every query length
the schedule holds at every capture size, whatever batch sizes draft that length: the
default rule's 65-token trees, drafted at batch 1 only, were also captured for 2 to 7
requests (up to 455 tokens). No step replays those graphs; they cost engine start time and
memory (at Qwen3.6-27B shapes they ran an H100 out of memory at batch 8 in 16 GiB of KV,
2026-12-05).

A batch of n requests drafting k tokens dispatches by its n (1 + k) tokens, and only a graph
of query length 1 + k with at least n requests can serve it. So of the graphs of one query
length, sorted by requests, the graph of m requests is the first that fits a batch of n
only for n between the previous graph's requests (exclusive) and m: it is replayed only if
some such n drafts that length. The others leave the capture list and the dispatch table;
every batch the schedule can form dispatches as before.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict

from vllm_tfm.vllm_glue.config import tfm_options


def query_len_by_batch(manager) -> list[int] | None:
    """``[n]``: the query length a batch of n running requests decodes at (index 0 unused),
    from the schedule ``_init_candidates`` captured; None where it captured none."""
    vllm_config = manager.vllm_config
    speculative = vllm_config.speculative_config
    spec_tokens = vllm_config.num_speculative_tokens
    # The condition under which vLLM's _init_candidates expands the schedule.
    if not (speculative is not None and speculative.uses_dynamic_speculative_decoding()
            and manager.decode_query_len > spec_tokens):
        return None
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    schedule = build_dynamic_sd_schedule_lookup(
        speculative.num_speculative_tokens_per_batch_size,
        vllm_max_batch_size=manager.max_num_reqs, vllm_num_speculative_tokens=spec_tokens)
    sampled_per_step = manager.decode_query_len - spec_tokens
    return [k + sampled_per_step for k in schedule]


def unreplayed(descs, query_len_of_batch: list[int]) -> set:
    """The uniform-decode descriptors among ``descs`` that no batch size replays (module
    docstring). Descriptors differing only in tokens and requests form one family."""
    families = defaultdict(list)
    for desc in descs:
        if desc.uniform_token_count is not None:
            families[dataclasses.replace(desc, num_tokens=0, num_reqs=0)].append(desc)
    largest_batch = len(query_len_of_batch) - 1
    unused = set()
    for members in families.values():
        previous = 0
        for desc in sorted(members, key=lambda d: d.num_reqs):
            batches = range(previous + 1, min(desc.num_reqs, largest_batch) + 1)
            if all(query_len_of_batch[n] != desc.uniform_token_count for n in batches):
                unused.add(desc)
            previous = desc.num_reqs
    return unused


def wrap_init_candidates(original):
    @functools.wraps(original)
    def _init_candidates(self) -> None:
        original(self)
        if tfm_options(self.vllm_config) is None:
            return
        query_lens = query_len_by_batch(self)
        if query_lens is None:
            return
        captured = [d for descs in self._capture_descs.values() for d in descs]
        unused = unreplayed(captured, query_lens)
        if not unused:
            return
        for mode, descs in self._capture_descs.items():
            self._capture_descs[mode] = [d for d in descs if d not in unused]
        for key, descs in list(self._candidates.items()):
            kept = [d for d in descs if d not in unused]
            if kept:
                self._candidates[key] = kept
            else:  # no batch the schedule forms has this many tokens
                del self._candidates[key]
        from vllm.logger import init_logger

        init_logger(__name__).info(
            "dflash_tfm: %d of %d graphs are never replayed by the budget schedule and are "
            "not captured", len(unused), len(captured))

    return _init_candidates
