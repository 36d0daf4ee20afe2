"""The user-facing options of ``{"method": "dflash_tfm", ...}``.

Parsed and checked here, before any engine starts, so a bad value fails with
a message naming the field. No vLLM (nor torch) import: the glue hands us the
plain dict. The defaults and rules declared here (pool size, fanout, expand
width, draft depth) are the ones the drafting core and the tools use too.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

METHOD = "dflash_tfm"
TREE_KINDS = ("weaver", "ddtree", "chain")
# Tree kinds with a sampled form (children drawn without replacement from the drafter).
SAMPLED_TREE_KINDS = ("weaver", "ddtree")
# verify "auto", per tree kind: sampled requests at this temperature or above get
# sampled trees + traversal, cooler ones deterministic trees + target-only. Measured on
# the tiny trained family (BENCHMARKS.md, "Sampled trees"): sampled DDTrees win at
# T = 0.2, 0.5 and 1; sampled Weaver trees win at T = 1 and tie at 0.5 and 0.2, where
# Weaver's best-first tree already follows the cooled target (q is a T = 1 law). Since the
# sampled Weaver tree ranks its slots by rank (stop 43), T = 0.5 gave it +2.8 % over the
# deterministic tree in unpaired decoding runs (noise), and the deterministic tree keeps
# ~5 % more per position paired on the same contexts (tools/compare_trees.py, BENCHMARKS.md
# "T = 1 on 64 new held-out prompts"): 0.75 stays.
AUTO_SAMPLED_TREE_MIN_TEMPERATURE = {"weaver": 0.75, "ddtree": 0.0}
VERIFY_MODES = ("auto", "greedy", "target_only", "traversal")
DEFAULT_BUDGET = 64
# Root + budget nodes must fit one tree of at most 128 nodes (the kernels'
# tile limit and vLLM's MAX_SPEC_LEN).
MAX_BUDGET = 127
MAX_EXPAND_WIDTH = 32
# Pool of a baseline tree (ddtree / chain) when none is given: the paper's top-512.
DEFAULT_BASELINE_POOL = 512
# Children a Weaver node pushes to the frontier (DESIGN.md section 3: c = 8).
DEFAULT_FANOUT = 8
# DFlash drafters are trained with a block of 16: bonus token + 15 masks.
DFLASH_DRAFT_DEPTH = 15
# Tokens one target forward may score across the batch before the default budget rule
# shrinks the trees. Measured at Qwen3.6-27B shapes on the H200 (DESIGN.md section 4, one
# CUDA graph): 65 tokens cost 1.34x one decode token, 129 tokens 2.23x, so the knee past
# which the forward stops costing about one weight read lies between; 96 keeps budget 64
# for one request and not 127. tools/bench_speed.py measures the step times to refine it.
DEFAULT_STEP_TOKENS = 96
# Tokens one target forward may score across the batch before the default budget rule
# shrinks the trees below the chain's width (down to DEFAULT_MIN_BUDGET): past the compute
# roof a step's time grows with its tokens. Measured at Qwen3.6-27B shapes on an H100 under
# CUDA graphs (BENCHMARKS.md, "Stop 42"): at 16 requests, 8-node trees (144 tokens) took
# 42.95 ms against 52.78 at 16 nodes (272 tokens), at 32 requests 57.76 against 87.35, while
# the tiny family accepts 2.90 tokens per step at budget 8 against 3.44 at 16 (0.84x): 8
# wins by 3.5 % and 27 % of projected tokens/s. At 8 requests (136 tokens at 16) the step
# model from those cells puts budget 8 just short of break-even, so 16 stays below 256.
DEFAULT_COMPUTE_TOKENS = 256
# The smallest budget the default rule picks: the smallest whose acceptance is measured.
DEFAULT_MIN_BUDGET = 8


@dataclasses.dataclass(frozen=True)
class TfmOptions:
    """Validated ``dflash_tfm`` options, carried to every process."""

    budget: int = DEFAULT_BUDGET
    tree: str = "weaver"
    verify: str = "auto"
    weaver: str | None = None
    expand_width: int | None = None
    fanout: int = DEFAULT_FANOUT
    # None until resolved against the checkpoint (``resolve_candidate_pool``).
    candidate_pool: int | None = None
    draft_depth: int = DFLASH_DRAFT_DEPTH
    # The per-step budget rule: ((max running requests, budget), ...), max running
    # requests ascending; a step with R requests takes the first row with R <= max, the
    # last row's budget past the table. None: ``default_budget_table(budget)``.
    budget_by_batch: tuple[tuple[int, int], ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TfmOptions:
        table = values.get("budget_by_batch")
        if table is not None:  # JSON and pickles may hand back lists
            values = {**values, "budget_by_batch": tuple(tuple(row) for row in table)}
        return cls(**values)

    @property
    def budget_table(self) -> tuple[tuple[int, int], ...]:
        if self.budget_by_batch is not None:
            return self.budget_by_batch
        return default_budget_table(self.budget, self.draft_depth)

    @property
    def step_budgets(self) -> tuple[int, ...]:
        """Every budget ``step_budget`` can pick, ascending: a runner that captures one
        graph per tree size sizes its captures from these."""
        return tuple(sorted({budget for _, budget in self.budget_table}))

    def step_budget(self, num_requests: int) -> int:
        """This step's tree budget for ``num_requests`` running requests (see
        ``budget_for_batch``)."""
        return budget_for_batch(self.budget_table, num_requests)

    def expand_width_for(self, budget: int) -> int:
        """Weaver nodes expanded per call for a tree of ``budget`` nodes: the user's
        ``expand_width`` (cut to the budget), else ``default_expand_width``."""
        if self.expand_width is not None:
            return min(self.expand_width, budget)
        return default_expand_width(budget)

    @property
    def resolved_expand_width(self) -> int:
        return self.expand_width_for(self.budget)


def default_expand_width(budget: int) -> int:
    """Nodes expanded per Weaver call: ceil(budget / 16), in [1, MAX_EXPAND_WIDTH]."""
    return max(1, min(-(-budget // 16), MAX_EXPAND_WIDTH))


def powers_of_two_up_to(limit: int) -> tuple[int, ...]:
    """The powers of two below ``limit``, and ``limit`` itself, ascending."""
    values = {limit}
    value = 1
    while value < limit:
        values.add(value)
        value *= 2
    return tuple(sorted(values))


def budget_levels(max_budget: int) -> tuple[int, ...]:
    """The tree budgets a per-step rule may pick under ``max_budget``: the powers of two
    below it, and itself. Few and discrete on purpose: a runner that replays CUDA graphs
    captures one uniform batch of 1 + budget tokens per request for each level."""
    return powers_of_two_up_to(max_budget)


def default_budget_table(max_budget: int, draft_depth: int = DFLASH_DRAFT_DEPTH,
                         step_tokens: int = DEFAULT_STEP_TOKENS,
                         compute_tokens: int = DEFAULT_COMPUTE_TOKENS) -> tuple[tuple[int, int], ...]:
    """The budget rule when the user gives none, as ((max running requests, budget), ...).

    The cost model: a target forward over T tokens costs about one weight read while T
    stays under ``step_tokens`` and grows with T past it, while the accepted length grows
    slowly (about logarithmically) with the budget. So B requests get the largest level
    (``budget_levels``) whose B x (1 + budget) tokens fit ``step_tokens``, but not less
    than the chain's width, the smallest level >= ``draft_depth`` (a 15-deep DFlash block:
    16 nodes): such a tree scores about as many tokens as the chain the method contains
    and accepts more (BENCHMARKS.md, tiny family at T = 0: DDTree(16) 2.56 and
    Weaver(16) 3.44 tokens per step against the chain's 1.93). Past the compute roof,
    ``compute_tokens``, where the step's time grows with every token, the levels below
    the chain's width follow the same way down to ``DEFAULT_MIN_BUDGET``: a tree of half
    the nodes accepts more than half as much (budget 8: 2.90).
    """
    levels = budget_levels(max_budget)
    floor = next((level for level in levels if level >= draft_depth), max_budget)
    lowest = min(floor, max(level for level in levels if level <= DEFAULT_MIN_BUDGET))
    table: list[tuple[int, int]] = []
    for budget in reversed(levels):
        if budget <= lowest:
            break
        tokens = step_tokens if budget > floor else compute_tokens
        largest_batch = tokens // (1 + budget)
        if largest_batch >= 1 and (not table or largest_batch > table[-1][0]):
            table.append((largest_batch, budget))
    table.append((MAX_BATCH, lowest))
    return tuple(table)


# The last row of a default budget table: every larger batch.
MAX_BATCH = 1 << 20


def budget_for_batch(table: tuple[tuple[int, int], ...], num_requests: int) -> int:
    """The budget of the first row whose max running requests is >= ``num_requests``;
    the last row's for larger batches."""
    for max_batch, budget in table:
        if num_requests <= max_batch:
            return budget
    return table[-1][1]


def batch_size_schedule(table: tuple[tuple[int, int], ...],
                        max_budget: int) -> list[tuple[int, int, int]]:
    """A budget table as vLLM's ``num_speculative_tokens_per_batch_size`` (model runner
    V2's dynamic speculative decoding): inclusive (first batch, last batch, k) ranges,
    k capped at ``max_budget``. vLLM carries the last k past the last range, as the
    table does."""
    schedule = []
    first = 1
    for max_batch, budget in table:
        schedule.append((first, max_batch, min(budget, max_budget)))
        first = max_batch + 1
    return schedule


def budget_table_from_schedule(schedule: list[tuple[int, int, int]],
                               max_budget: int) -> tuple[tuple[int, int], ...]:
    """The budget table that picks what a (validated, sorted) vLLM schedule picks: a gap
    between ranges takes the k before it, and so does every batch past the last range
    (``build_dynamic_sd_schedule_lookup``); k capped at ``max_budget``."""
    table: list[tuple[int, int]] = []
    for first, last, budget in schedule:
        if table and first > table[-1][0] + 1:  # the gap keeps the previous k
            table[-1] = (first - 1, table[-1][1])
        table.append((last, min(budget, max_budget)))
    return tuple(table)


def _budget_table_field(values: dict[str, Any], max_budget: int):
    """``budget_by_batch``: [[max running requests, budget], ...], max running requests
    strictly ascending, every budget one of ``budget_levels(max_budget)``."""
    table = values.get("budget_by_batch")
    if table is None:
        return None
    allowed = list(budget_levels(max_budget))
    shape = (f"speculative_config['budget_by_batch'] must be a non-empty list of "
             f"[max running requests, budget] pairs with max running requests ascending "
             f"and budgets in {allowed} (powers of two up to num_speculative_tokens, "
             f"and num_speculative_tokens itself), got {table!r}")
    if not isinstance(table, (list, tuple)) or not table:
        raise ValueError(shape)
    rows = []
    for row in table:
        if (not isinstance(row, (list, tuple)) or len(row) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) for v in row)):
            raise ValueError(shape)
        max_batch, budget = row
        if max_batch < 1 or (rows and max_batch <= rows[-1][0]):
            raise ValueError(shape)
        if budget not in allowed:
            raise ValueError(
                f"speculative_config['budget_by_batch']: budget {budget} for batches up to "
                f"{max_batch} must be one of {allowed} (powers of two up to "
                f"num_speculative_tokens = {max_budget}, and {max_budget} itself)"
            )
        rows.append((max_batch, budget))
    return tuple(rows)


def default_candidate_pool(vocab_size: int, weaver_pool_size: int | None) -> int:
    """The Weaver's ``candidate_pool_size`` (what it was trained on), else
    ``min(DEFAULT_BASELINE_POOL, vocab_size)``."""
    if weaver_pool_size is not None:
        return weaver_pool_size
    return min(DEFAULT_BASELINE_POOL, vocab_size)


# Keys of the speculative config that belong to dflash_tfm, not to vLLM.
TFM_KEYS = ("weaver", "tree", "verify", "expand_width", "fanout", "candidate_pool",
            "budget_by_batch")


def _int_field(values: dict[str, Any], name: str, default: int | None, low: int, high: int):
    value = values.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"speculative_config['{name}'] must be an integer in [{low}, {high}], "
            f"got {value!r}"
        )
    if not low <= value <= high:
        raise ValueError(
            f"speculative_config['{name}'] must be in [{low}, {high}], got {value}"
        )
    return value


def _choice_field(values: dict[str, Any], name: str, default: str, allowed: tuple[str, ...]):
    value = values.get(name, default)
    if value not in allowed:
        raise ValueError(
            f"speculative_config['{name}'] must be one of {list(allowed)}, got {value!r}"
        )
    return value


def split_speculative_config(
    config: dict[str, Any], vllm_keys: set[str]
) -> tuple[TfmOptions, dict[str, Any]]:
    """Split a ``dflash_tfm`` speculative config into our options and vLLM's.

    Args:
        config: the user's dict, ``method == "dflash_tfm"``.
        vllm_keys: the field names vLLM's SpeculativeConfig accepts.

    Returns:
        The validated options and the dict to hand to vLLM as a ``dflash``
        config with ``num_speculative_tokens`` = the tree budget.
    """
    config = {key.replace("-", "_"): value for key, value in config.items()}
    unknown = sorted(set(config) - set(TFM_KEYS) - vllm_keys)
    if unknown:
        raise ValueError(
            f"unknown speculative_config key(s) {unknown} for method '{METHOD}'; "
            f"dflash_tfm adds {list(TFM_KEYS)} to vLLM's speculative options"
        )
    if not config.get("model"):
        raise ValueError(
            f"speculative_config['model'] must name the DFlash drafter for method '{METHOD}'"
        )
    budget = _int_field(config, "num_speculative_tokens", DEFAULT_BUDGET, 1, MAX_BUDGET)
    tree = _choice_field(config, "tree", "weaver", TREE_KINDS)
    verify = _choice_field(config, "verify", "auto", VERIFY_MODES)
    candidate_pool = _int_field(config, "candidate_pool", None, 1, 1 << 20)
    fanout = _int_field(config, "fanout", DEFAULT_FANOUT, 1, candidate_pool or 1 << 20)
    expand_width = _int_field(config, "expand_width", None, 1, MAX_EXPAND_WIDTH)
    budget_by_batch = _budget_table_field(config, budget)
    weaver = config.get("weaver")
    if tree == "weaver":
        if not weaver:
            raise ValueError(
                "speculative_config['weaver'] is required when tree is 'weaver' "
                "(a Weaver .pth or a safetensors directory); or choose "
                "tree 'ddtree' or 'chain'"
            )
    if weaver is not None:
        if not isinstance(weaver, str) or not os.path.exists(weaver):
            raise ValueError(
                f"speculative_config['weaver'] = {weaver!r} does not exist"
            )
    options = TfmOptions(
        budget=budget,
        tree=tree,
        verify=verify,
        weaver=weaver if tree == "weaver" else None,
        expand_width=expand_width,
        fanout=fanout,
        candidate_pool=candidate_pool,
        budget_by_batch=budget_by_batch,
    )
    vllm_config = {k: v for k, v in config.items() if k not in TFM_KEYS}
    vllm_config["method"] = "dflash"
    vllm_config["num_speculative_tokens"] = budget
    return options, vllm_config


def resolve_candidate_pool(
    options: TfmOptions, vocab_size: int, weaver_pool_size: int | None
) -> TfmOptions:
    """The options with ``candidate_pool`` fixed by the checkpoints when unset.

    Tree ``weaver``: the Weaver's ``candidate_pool_size`` (what it was trained
    on); ``ddtree`` / ``chain``: ``min(512, vocab_size)``. An explicit value
    must fit both the vocabulary and the Weaver's pool; ``fanout`` must fit
    the resolved pool.
    """
    pool = options.candidate_pool
    if pool is None:
        pool = default_candidate_pool(vocab_size, weaver_pool_size)
        if pool > vocab_size:
            raise ValueError(
                f"speculative_config['weaver']: candidate_pool_size {pool} exceeds the "
                f"target's vocabulary size {vocab_size}"
            )
    elif pool > vocab_size:
        raise ValueError(
            f"speculative_config['candidate_pool'] must be <= the vocabulary size "
            f"{vocab_size}, got {pool}"
        )
    elif weaver_pool_size is not None and pool > weaver_pool_size:
        raise ValueError(
            f"speculative_config['candidate_pool'] = {pool} exceeds the Weaver's "
            f"candidate_pool_size {weaver_pool_size}"
        )
    if options.fanout > pool:
        raise ValueError(
            f"speculative_config['fanout'] must be in [1, {pool}] (the candidate pool), "
            f"got {options.fanout}"
        )
    return dataclasses.replace(options, candidate_pool=pool)
