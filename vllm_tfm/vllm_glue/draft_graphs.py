"""The engine's draft rounds as CUDA graphs: which rounds a proposer keeps, and the patch
that captures them right after vLLM captures its own graphs.

The proposer (proposer.py) grows deterministic trees through ``DraftRound``
(drafting/draft_round.py): the round of one (tree kind, budget, batch bucket, D, P)
captured once and replayed, where ``draft_trees`` launches ~17 Weaver calls' kernels one
by one (BENCHMARKS.md, "Draft rounds at the target's pace": Weaver budget 64 at batch 1,
25.5 ms eager, 1.4 ms replayed). Off CUDA the same rounds run their buffers eagerly.
This is model runner V1's scheme: on V2 the round runs inside vLLM's own FULL draft graph,
bucketed by vLLM's dispatch (v2/speculator.py says why), and none of this module applies.

Batch buckets are the powers of two below max_num_seqs, and max_num_seqs itself. Not
vLLM's cudagraph capture sizes divided by 1 + num_speculative_tokens: those count the
target's tokens of chain steps (at num_speculative_tokens 127 a capture size of 512 gives
buckets up to 4), and no capture size is a tree step's. A round's time grows slowly with
its batch (Weaver budget 64: 1.44 ms at batch 1, 1.79 ms at 8, 2.57 ms at 32), so running
a batch in a bucket up to twice its size costs little, and log2(max_num_seqs) + 1 buckets
keep the capture short. Only the (budget, bucket) pairs the budget rule can pick are
built: a batch of n takes ``step_budget(n)`` and the smallest bucket >= n.

Rounds are built at set moments only: after vLLM's graph capture (``wrap_capture_model``),
at ``load_model`` off CUDA, and when a tool calls ``TreeProposer.prepare_rounds`` while no
step runs. Never lazily while serving: a capture while another thread issues CUDA work
fails (capture_error_mode "global"). A step with no built round drafts through
``draft_trees``, as do sampled-children trees and grammar-constrained rounds.

Memory: a round's static buffers are its pools, [bucket, D, P] int64 ids + float32 scores
(98 KiB per request at D 15, P 512), Weaver's inputs, bucket x (D + 1) x d_model in the
Weaver's dtype (160 KiB per request at d_model 5120, bf16), and its output trees; the
rounds' intermediates share one graph pool (``DraftRound``'s ``pool``), so they cost the
largest round's, not their sum. The capture logs what it took.
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple

import torch
from vllm.config import CUDAGraphMode
from vllm.logger import init_logger

from vllm_tfm.drafting.draft_round import CandidatePools, DraftRound
from vllm_tfm.options import TfmOptions, powers_of_two_up_to

logger = init_logger(__name__)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes rounds are built for: powers of two below ``max_batch``, and it."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
    return powers_of_two_up_to(max_batch)


def bucket_for(buckets: tuple[int, ...], batch: int) -> int | None:
    """The smallest bucket holding ``batch`` requests; None past the largest."""
    return next((bucket for bucket in buckets if bucket >= batch), None)


def round_shapes(options: TfmOptions, buckets: tuple[int, ...]) -> list[tuple[int, int]]:
    """(budget, bucket) of every round the budget rule picks for 1..max(buckets) requests."""
    shapes = {(options.step_budget(batch), bucket_for(buckets, batch))
              for batch in range(1, buckets[-1] + 1)}
    return sorted(shapes)


class RoundKey(NamedTuple):
    tree: str
    budget: int
    bucket: int
    depth: int
    pool_size: int
    fanout: int
    expand_width: int


class DraftRounds:
    """One proposer's draft rounds, by :class:`RoundKey`.

    Args:
        max_batch: the engine's max_num_seqs. depth, pool_size: D and P of the
            proposer's pools. device: where trees grow. weaver: the engine's
            Weaver (tables prepared), None for engines without one.
    """

    def __init__(self, max_batch: int, depth: int, pool_size: int, device: torch.device,
                 weaver=None):
        self.buckets = batch_buckets(max_batch)
        self.depth, self.pool_size = depth, pool_size
        self.device, self.weaver = torch.device(device), weaver
        self.graphs = self.device.type == "cuda"
        self.rounds: dict[RoundKey, DraftRound] = {}
        self._graph_pool = None

    def _key(self, options: TfmOptions, tree: str, budget: int, bucket: int, depth: int,
             pool_size: int) -> RoundKey:
        return RoundKey(tree, budget, bucket, depth, pool_size, options.fanout,
                        options.expand_width_for(budget))

    def prepare(self, options: TfmOptions, tree: str) -> int:
        """Build every round of tree kind ``tree`` that ``options``' budget rule picks
        (kept ones stay); on CUDA each is captured as a CUDA graph. Returns the device
        bytes the new rounds took (0 off CUDA)."""
        keys = [self._key(options, tree, budget, bucket, self.depth, self.pool_size)
                for budget, bucket in round_shapes(options, self.buckets)]
        keys = [key for key in keys if key not in self.rounds]
        if not keys or not self.graphs:
            free_before = None
        else:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            free_before = torch.cuda.mem_get_info(self.device)[0]
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
        for key in keys:
            self.rounds[key] = DraftRound(
                key.tree, key.bucket, key.depth, key.pool_size, key.budget,
                device=self.device, weaver=self.weaver if key.tree == "weaver" else None,
                fanout=key.fanout, expand_width=key.expand_width, graph=self.graphs,
                pool=self._graph_pool,
            )
        if free_before is None:
            return 0
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return free_before - torch.cuda.mem_get_info(self.device)[0]

    def find(self, options: TfmOptions, budget: int, pools: CandidatePools) -> DraftRound | None:
        """The round for this step's ``pools`` ([n, D, P]) at tree ``options.tree`` and
        ``budget``; None where none was built."""
        batch, depth, pool_size = pools.ids.shape
        bucket = bucket_for(self.buckets, batch)
        if bucket is None:
            return None
        return self.rounds.get(self._key(options, options.tree, budget, bucket, depth,
                                         pool_size))


def wrap_capture_model(original):
    """After vLLM's own capture, a dflash_tfm runner's proposer captures its draft rounds
    (the tree kind of its options); the bytes they took join vLLM's count."""

    @functools.wraps(original)
    def capture_model(self) -> int:
        graph_bytes = original(self)
        if (getattr(self, "_tfm_options", None) is None
                or self.compilation_config.cudagraph_mode == CUDAGraphMode.NONE):
            return graph_bytes
        started = time.perf_counter()
        round_bytes = self.drafter.prepare_rounds()
        logger.info(
            "dflash_tfm: %d draft rounds captured in %.1f s, took %.3f GiB",
            self.drafter.num_rounds, time.perf_counter() - started, round_bytes / (1 << 30))
        return graph_bytes + round_bytes

    return capture_model
