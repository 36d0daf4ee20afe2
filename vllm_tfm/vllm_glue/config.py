"""``{"method": "dflash_tfm"}``: parse, check and translate before the engine starts.

vLLM's SpeculativeConfig knows no such method (a closed Literal, extra keys
forbidden). We run it as vLLM's own ``dflash`` (same drafter loading, aux
hidden states, KV groups) with ``num_speculative_tokens`` = the tree budget,
and carry our options in ``additional_config["dflash_tfm"]``, which every
process receives with the VllmConfig.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from vllm_tfm.options import (
    METHOD,
    TfmOptions,
    batch_size_schedule,
    budget_table_from_schedule,
    resolve_candidate_pool,
    split_speculative_config,
)
from vllm_tfm.vllm_glue.patches import vllm_major_minor
from vllm_tfm.vllm_glue.v2.choice import ENV, select_model_runner, tree_runner

ADDITIONAL_CONFIG_KEY = "dflash_tfm"
# vLLM's dynamic speculative decoding schedule (model runner V2): the budget rule there.
BATCH_SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"
# The one GPU attention backend whose forward the tree path wraps.
CUDA_ATTENTION_BACKEND = "TRITON_ATTN"
# Parallelism the tree path does not handle yet, and what it would need.
_WHOLE_KV_ROWS = "tree attention and the KV commit read and move whole KV rows, not split ones"
UNSUPPORTED_PARALLELISM = {
    "pipeline_parallel_size": "each stage would need the tree step and the accepted paths, "
                              "and the drafter the context layers of every stage",
    "decode_context_parallel_size": _WHOLE_KV_ROWS,
    "prefill_context_parallel_size": _WHOLE_KV_ROWS,
}
# Set to True on the SpeculativeConfig of an engine running dflash_tfm (vLLM only knows
# it as "dflash"). An instance attribute: it travels with the config wherever vLLM
# pickles or copies it, and nothing else (None, another engine's config, a new object
# at a reused id) carries it.
TREE_MARKER = "_vllm_tfm_tree"


def tfm_options(vllm_config) -> TfmOptions | None:
    """The options of a VllmConfig running dflash_tfm, else None.

    Both marks must be there: our options (which a user could also write into
    ``additional_config`` by hand) and the marker our config wrapper sets.
    """
    extra = vllm_config.additional_config or {}
    values = extra.get(ADDITIONAL_CONFIG_KEY)
    if values is None or not getattr(vllm_config.speculative_config, TREE_MARKER, False):
        return None
    return TfmOptions.from_dict(values)


def _speculative_fields() -> set[str]:
    from vllm.config import SpeculativeConfig

    return {field.name for field in dataclasses.fields(SpeculativeConfig)}


def wrap_create_engine_config(original):
    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        user_spec = self.speculative_config
        if not (isinstance(user_spec, dict) and user_spec.get("method") == METHOD):
            return original(self, *args, **kwargs)
        options, vllm_spec = split_speculative_config(user_spec, _speculative_fields())
        _check_engine_args(self)
        on_cpu = _on_cpu()
        runner = "v1" if on_cpu else choose_runner(self)  # V1: the only runner on CPU
        _check_async_scheduling(self.async_scheduling, runner)
        saved = (self.enable_prefix_caching, self.async_scheduling, self.additional_config,
                 self.attention_backend)
        if not on_cpu:
            # The tree path patches model runner V1 or plugs into V2 (vllm_glue/v2), over
            # the TRITON_ATTN backend either way.
            select_model_runner(runner)
            if self.attention_backend is None and self.attention_config.backend is None:
                # vLLM refuses both fields set, so only fill an unset choice.
                self.attention_backend = CUDA_ATTENTION_BACKEND
            vllm_spec.setdefault("attention_backend", CUDA_ATTENTION_BACKEND)
        options = batch_size_budgets(options, vllm_spec, runner)
        self.speculative_config = vllm_spec
        # GDN states advance along the accepted path only, in place: prefix
        # caching's state checkpoints ("align" mode) do not apply to trees. Async
        # scheduling: V2 keeps the user's choice (unset: vLLM's default, on); V1 never.
        self.enable_prefix_caching = False
        if runner != "v2":
            self.async_scheduling = False
        self.additional_config = {
            **(self.additional_config or {}),
            ADDITIONAL_CONFIG_KEY: options.to_dict(),
        }
        try:
            config = original(self, *args, **kwargs)
        finally:
            self.speculative_config = user_spec
            (self.enable_prefix_caching, self.async_scheduling, self.additional_config,
             self.attention_backend) = saved
        options = check_against_target(config, options)
        config.additional_config[ADDITIONAL_CONFIG_KEY] = options.to_dict()
        setattr(config.speculative_config, TREE_MARKER, True)
        return config

    return create_engine_config


def batch_size_budgets(options: TfmOptions, vllm_spec: dict, runner: str) -> TfmOptions:
    """One budget rule for the plugin and vLLM; ``vllm_spec`` (vLLM's speculative dict)
    is completed in place, the options returned follow it.

    On model runner V2 the rule is vLLM's dynamic speculative decoding: the scheduler
    picks each step's k from the number of scheduled requests and V2 captures FULL
    graphs for every 1 + k (vllm_glue/v2). So the user's ``budget_by_batch`` becomes
    ``num_speculative_tokens_per_batch_size`` (the default table when none is given); a
    schedule the user gave in that field becomes
    the plugin's rule instead. V1 keeps the plugin's rule
    alone (``tree_graphs.budget_rule_for_graphs``): vLLM would force PIECEWISE graphs
    on V1 for a "dflash" engine with a schedule.
    """
    user_schedule = vllm_spec.get(BATCH_SCHEDULE_KEY)
    if runner != "v2":
        if user_schedule is not None:
            raise ValueError(
                f"speculative_config['{BATCH_SCHEDULE_KEY}'] needs model runner V2 with "
                f"method '{METHOD}'; on model runner V1 give the rule as "
                "speculative_config['budget_by_batch']")
        return options
    if user_schedule is None:
        options = sized_to_rule(options, vllm_spec)
        schedule = batch_size_schedule(options.budget_table, options.budget)
        # A rule of one budget is vLLM's static num_speculative_tokens: no schedule, so
        # its scheduler keeps padding new decodes to the uniform length.
        if any(k != options.budget for _, _, k in schedule):
            vllm_spec[BATCH_SCHEDULE_KEY] = schedule
        return options
    if options.budget_by_batch is not None:
        raise ValueError(
            f"speculative_config sets both 'budget_by_batch' and '{BATCH_SCHEDULE_KEY}' "
            f"with method '{METHOD}': give the per-batch budget in one of them")
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    try:
        schedule = validate_and_normalize_dynamic_sd_schedule(user_schedule)
    except ValueError as error:
        raise ValueError(f"speculative_config['{BATCH_SCHEDULE_KEY}']: {error}") from None
    if any(k == 0 for _, _, k in schedule):
        raise ValueError(
            f"speculative_config['{BATCH_SCHEDULE_KEY}']: every k must be in [1, "
            f"num_speculative_tokens = {options.budget}] with method '{METHOD}' (a tree "
            f"step drafts at least one node), got {user_schedule!r}")
    return sized_to_rule(dataclasses.replace(
        options, budget_by_batch=budget_table_from_schedule(schedule, options.budget)), vllm_spec)


def sized_to_rule(options: TfmOptions, vllm_spec: dict) -> TfmOptions:
    """The options with ``budget`` (and vLLM's ``num_speculative_tokens``) lowered to the
    largest k the budget rule drafts, and the rule kept as an explicit table.

    Model runner V2 warms up and profiles memory with steps of num_speculative_tokens
    drafts, while the tree speculator captures a draft round for each k of the rule
    only: with ``num_speculative_tokens`` = 127 the default rule (at most 64: a 128-node
    tree does not fit DEFAULT_STEP_TOKENS) left the warm-up drafting a k no round
    holds. num_speculative_tokens is the most a step may draft, so an engine sized for
    the rule's largest k serves the same steps with smaller buffers."""
    largest = max(options.step_budgets)
    if largest == options.budget:
        return options
    vllm_spec["num_speculative_tokens"] = largest
    return dataclasses.replace(options, budget=largest, budget_by_batch=options.budget_table)


def _check_engine_args(engine_args) -> None:
    if engine_args.enable_prefix_caching:
        raise ValueError(
            "enable_prefix_caching must be False with speculative method "
            f"'{METHOD}' (tree commits do not keep per-block GDN checkpoints)"
        )
    # Any tensor_parallel_size works: the drafter and target shard as vLLM shards them,
    # the Weaver reads the vocabulary gathered whole, and the first rank's trees and
    # accepted paths are broadcast to the others (proposer.py, runner.py).
    for name, why in UNSUPPORTED_PARALLELISM.items():
        if getattr(engine_args, name) != 1:
            raise ValueError(
                f"{name} must be 1 with speculative method '{METHOD}', got "
                f"{getattr(engine_args, name)} ({why})"
            )
    if _on_cpu():
        return
    choose_runner(engine_args)  # refuses VLLM_USE_V2_MODEL_RUNNER=1 where V2 cannot run
    chosen = engine_args.attention_backend or engine_args.attention_config.backend
    name = getattr(chosen, "name", chosen)
    if name not in (None, CUDA_ATTENTION_BACKEND):
        raise ValueError(
            f"attention_backend must be {CUDA_ATTENTION_BACKEND!r} (or unset) with speculative "
            f"method '{METHOD}' on GPUs, got {name!r}"
        )


def choose_runner(engine_args) -> str:
    """The model runner ("v1" or "v2") of a dflash_tfm engine on CUDA (v2/choice.py)."""
    return tree_runner(os.environ.get(ENV), True, vllm_major_minor(),
                       engine_args.tensor_parallel_size)


def _check_async_scheduling(async_scheduling: bool | None, runner: str) -> None:
    """Async scheduling prepares step n + 1 while step n runs, so the host's token
    counts are upper bounds. Model runner V2's tree steps read the device's counts and
    take it, on by default as for vLLM's own methods (greedy output equal to no
    speculation on the H200, BENCHMARKS.md stop 20); V1's read the host's and refuse it."""
    if async_scheduling and runner != "v2":
        raise ValueError(
            f"async_scheduling must be False with speculative method '{METHOD}' on model "
            "runner V1 (its tree steps read the scheduler's host token counts); model "
            "runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, CUDA) takes async_scheduling=True"
        )


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def check_against_target(config, options: TfmOptions) -> TfmOptions:
    """Check drafter, Weaver and budget against the target, naming the field.

    Returns the options with what the checkpoints fix (the candidate pool) filled in.
    """
    target = config.model_config.hf_config
    target_text = target.get_text_config() if hasattr(target, "get_text_config") else target
    draft_config = config.speculative_config.draft_model_config.hf_config
    hidden = target_text.hidden_size
    vocab = target_text.vocab_size
    for name, expected in (("hidden_size", hidden), ("vocab_size", vocab)):
        got = getattr(draft_config, name, expected)
        if got != expected:
            raise ValueError(
                f"speculative_config['model']: the DFlash drafter's {name} is {got}, "
                f"the target's is {expected}"
            )
    max_tokens = config.scheduler_config.max_num_batched_tokens
    if options.budget + 1 > max_tokens:
        raise ValueError(
            f"speculative_config['num_speculative_tokens'] = {options.budget} does not "
            f"fit max_num_batched_tokens = {max_tokens} (needs budget + 1)"
        )
    weaver_pool_size = None
    if options.weaver is not None:
        from vllm_tfm.drafting.weaver_checkpoint import load_weaver

        try:
            weaver = load_weaver(options.weaver, target_hidden_size=hidden,
                                 target_vocab_size=vocab)
        except ValueError as error:
            raise ValueError(f"speculative_config['weaver']: {error}") from None
        weaver_pool_size = weaver.config.candidate_pool_size
    return resolve_candidate_pool(options, vocab, weaver_pool_size)
