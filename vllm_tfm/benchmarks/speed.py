"""The speed proof (tools/bench_speed.py): engine-step times inside vLLM, split by phase,
for plain decoding, vLLM's own ``dflash`` chain and ``dflash_tfm``; tokens/s projected
from them and a stated mean accepted length; concurrent requests that fit a fixed memory
budget, read from each engine's own KV-cache configuration.

Shapes "qwen3.6-27b" (CUDA, the GPU harness tools/gpu_vllm): the target is Qwen3.6-27B's
text model as ``qwen3_5_text`` (``bench_training.QWEN36_27B_TARGET``), the DFlash drafter
of the published shape (``QWEN36_27B_DFLASH``), both ``load_format="dummy"`` (random bf16:
a step's time does not depend on the weights' values), and a random Weaver of the
published dimensions (``QWEN36_WEAVER_ARGS``). Shapes "tiny" (the smoke mode, CPU): the
tiny family, eager.

One engine per method, built for the largest batch and the longest context. Prompts are
random token ids (no tokenizer). Per context, batches from the smallest: each adds requests
to the running ones (prefilled while those decode), up to what the engine's KV / state
memory admits; then each setting is measured on that batch. On model runner V1 the
``dflash_tfm`` engine starts with a Weaver and the largest budget; between measurements
the benchmark replaces its proposer's options (tree kind and a one-row
``budget_by_batch`` table: see vllm_glue/proposer.py) instead of starting an engine per
configuration. On V2 an engine drafts the tree kind and budget (or budget rule) it was
started with (``engine_budgets``). After every switch one step is discarded (it verifies
trees drafted under the previous setting).

Step period = wall time of one ``LLMEngine.step`` (the engine core's whole step:
scheduling, the runner, output processing); phases from ``step_phases`` (CUDA events);
rest = period - the phases. Projected tokens/s = tau x batch / period, for tau stated,
not measured (random weights accept nothing meaningful): the paper's regime and the
trained tiny family's ``eval_acceptance`` numbers.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import json
import os
import random
import statistics
import time
from pathlib import Path

from vllm_tfm.benchmarks.gpu_clocks import ClockSampler
from vllm_tfm.benchmarks.memory_trace import trace_engine_start
from vllm_tfm.benchmarks.step_phases import (
    PHASES,
    collect_steps,
    install_on_worker,
    model_runner_of,
    phase_medians,
    profile_engine,
    profile_file_name,
    set_recording,
)
from vllm_tfm.options import (
    DFLASH_DRAFT_DEPTH,
    MAX_BATCH,
    MAX_BUDGET,
    TfmOptions,
    default_budget_table,
)

# The engine core in this process (its scheduler's KV-cache config and the runner's phase
# timers are read directly), offline, vLLM's own sampler kernels.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0",
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
PLAIN, VLLM_DFLASH, TFM = "plain", "vllm dflash (15)", "dflash_tfm"
# The paper's regime (its text gives ratios to the tuned chain, not absolute tau):
# TfM(64) accepts 1.77x the chain's length, DDTree(64) 1.34x.
PAPER_CHAIN_TAUS = (4.0, 5.0)
PAPER_RATIO_TO_CHAIN = {("weaver", 64): 1.77, ("ddtree", 64): 1.34}
# The trained tiny family's measured tau (BENCHMARKS.md, "Mean accepted length").
OURS_ACCEPTANCE = (Path(__file__).resolve().parents[2]
                   / "models/tiny_trained/eval_acceptance_h200.json")
EVAL_METHODS = {"weaver": "tfm", "ddtree": "ddtree", "chain": "chain"}
PROJECTION_NOTE = ("Projected tokens/s are a projection from measured step times and a "
                   "stated mean accepted length tau (tokens per step per request), not "
                   "measured throughput: random weights accept nothing meaningful.")


@dataclasses.dataclass(frozen=True)
class Shapes:
    name: str
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    budgets: tuple[int, ...]
    steps: int  # measured steps per cell
    # The fixed KV / state budget every engine gets; None: vLLM's defaults instead (the KV
    # sized by its memory profile at gpu_memory_utilization 0.9, its max_num_seqs,
    # max_num_batched_tokens and graph capture sizes): the engine a user starts.
    memory_bytes: int | None
    # Batches at the contexts past the shortest (prefill and KV grow with the context);
    # None: ``batches``.
    long_batches: tuple[int, ...] | None = None
    # Every request's sampling temperature (0: greedy; above 0 seeded per request, so
    # dflash_tfm's sampled trees and traversal verification are in the step times).
    temperature: float = 0.0
    # The CUDA engines' compilation: "none" (mode 0) or "inductor" (vLLM's default
    # torch.compile), both with FULL decode graphs (gpu_checks.CUDA_GRAPH_SETTINGS).
    compilation: str = "none"
    # dflash_tfm's Weaver nodes expanded per call (speculative config ``expand_width``);
    # None: the plugin's default. Projections keep the stated tau of the default width.
    expand_width: int | None = None
    # With vLLM's defaults (memory_bytes None), the one setting a user must give: at
    # Qwen3.6-27B shapes on an H100 vLLM 0.33's default of 1024 sequences exceeds the GDN
    # state blocks that fit, and no engine starts, plain decoding's included (BENCHMARKS.md,
    # "Stop 43 device calls"). None: vLLM's default.
    max_num_seqs: int | None = None

    def batches_at(self, context: int) -> tuple[int, ...]:
        if context == min(self.contexts) or self.long_batches is None:
            return self.batches
        return self.long_batches


SHAPES = {
    # 40 GiB of KV / state: a fixed budget skips vLLM's memory profiling, so what the 141 GB
    # leave after it and the 50 GiB of weights is all a step's activations get (at 48 GiB
    # the B = 32 tree step ran out of memory, BENCHMARKS.md "Stop 19 device calls").
    "qwen3.6-27b": Shapes("qwen3.6-27b", (1024, 8192), (1, 4, 8, 16, 32),
                          (16, 32, 64, MAX_BUDGET), 6, 40 << 30),
    "tiny": Shapes("tiny", (32, 64), (1, 2), (4, 8), 2, 64 << 20),
}

GRAPH_SETTING = {"none": "full-decode", "inductor": "compiled-full-decode"}
COMPILATION_NOTE = {"none": "mode 0", "inductor": "torch.compile (Inductor)"}


def tfm_settings(trees: tuple[str, ...], budgets: tuple[int, ...],
                 rule_only: bool = False) -> list[tuple[str, int | None]]:
    """(tree kind, budget) settings of the dflash_tfm engine, in measuring order: the
    issue's targets first (Weaver(64), the chain, the batch-size-aware rule, DDTree(64)),
    then every other budget. Budget None is the plugin's own rule (``rule_only``: that
    setting alone). A chain is the DFlash block whatever the budget: it runs once, at the
    smallest budget of at least the block's depth."""
    if rule_only:
        return [("weaver", None)] if "weaver" in trees else []
    settings: list[tuple[str, int | None]] = []
    for tree in trees:
        if tree == "chain":
            settings.append(("chain", next((b for b in budgets if b >= DFLASH_DRAFT_DEPTH),
                                           max(budgets))))
            continue
        settings += [(tree, budget) for budget in budgets]
        if tree == "weaver":
            settings.append(("weaver", None))
    first = [("weaver", 64), ("chain", None), ("weaver", None), ("ddtree", 64)]

    def priority(setting: tuple[str, int | None]) -> int:
        tree, budget = setting
        key = (tree, None) if tree == "chain" else setting
        return first.index(key) if key in first else len(first)

    return sorted(settings, key=priority)


# -- models ----------------------------------------------------------------------------

def write_qwen36_models(root: Path) -> dict[str, str]:
    """Config-only target and drafter directories (weights come from load_format dummy)
    and a random Weaver .pth of the published dimensions."""
    from vllm_tfm.drafting.weaver import WeaverConfig
    from vllm_tfm.drafting.weaver_checkpoint import random_weaver, save_weaver_public
    from vllm_tfm.training import train_weaver
    from vllm_tfm.training.bench_training import (
        QWEN36_27B_DFLASH,
        QWEN36_27B_TARGET,
        QWEN36_WEAVER_ARGS,
    )

    paths = {"target": root / "target", "dflash": root / "dflash"}
    for name, config in (("target", QWEN36_27B_TARGET), ("dflash", QWEN36_27B_DFLASH)):
        paths[name].mkdir(parents=True, exist_ok=True)
        (paths[name] / "config.json").write_text(json.dumps(config, indent=1))
    weaver_path = root / "weaver.pth"
    if not weaver_path.exists():
        shape = train_weaver.parse_args(["--out", "-", "--features", "-", *QWEN36_WEAVER_ARGS])
        hidden = QWEN36_27B_TARGET["hidden_size"]
        config = WeaverConfig(d_model=hidden, d_embed=hidden, d_rank=shape.d_rank,
                              num_layers=shape.num_layers, num_heads=shape.num_heads,
                              mlp_dim=shape.mlp_dim, layout=shape.layout,
                              K=QWEN36_27B_DFLASH["block_size"] - 1,
                              candidate_pool_size=shape.pool_size)
        save_weaver_public(random_weaver(config, seed=0), weaver_path,
                           metadata={"target": "Qwen3.6-27B shapes, random"})
    return {"target": str(paths["target"]), "dflash": str(paths["dflash"]),
            "weaver": str(weaver_path), "vocab_size": QWEN36_27B_TARGET["vocab_size"]}


def tiny_models() -> dict[str, str]:
    from vllm_tfm.tiny.family import VOCAB_SIZE, build_family

    family = build_family()
    return {"target": str(family.target), "dflash": str(family.dflash),
            "weaver": str(family.weaver), "vocab_size": VOCAB_SIZE}


# -- engines ---------------------------------------------------------------------------

def speculative_config(method: str, models: dict, max_budget: int,
                       budget_by_batch: tuple[tuple[int, int], ...] | None = None,
                       expand_width: int | None = None, tree: str | None = None) -> dict | None:
    if method == PLAIN:
        return None
    config = {"model": models["dflash"], "attention_backend": "TRITON_ATTN"}
    if method == VLLM_DFLASH:
        return {**config, "method": "dflash", "num_speculative_tokens": DFLASH_DRAFT_DEPTH}
    config = {**config, "method": "dflash_tfm", "tree": tree or "weaver",
              "weaver": models["weaver"], "num_speculative_tokens": max_budget}
    if budget_by_batch is not None:
        config["budget_by_batch"] = [list(row) for row in budget_by_batch]
    if expand_width is not None:
        config["expand_width"] = expand_width
    return config


def engine_kwargs(shapes: Shapes, runner: str, query_lens=lambda batch: (1 + DFLASH_DRAFT_DEPTH,),
                  reserved_len: int = 1 + DFLASH_DRAFT_DEPTH) -> dict:
    """LLM keyword arguments: on CUDA the GPU check's engine settings with full decode
    graphs (tools/gpu_e2e.py) captured for every measured batch of one token and of each
    of ``query_lens(batch)`` tokens per request (1 + every k the engine's steps draft at
    that batch: the rule engine's 65-token trees at batch 1 only; capturing them at batch 8,
    520 tokens, ran an H100 out of memory in 16 GiB of KV), on CPU the
    tests' CPU settings; one engine for the largest batch and the longest context. The
    DFlash drafter's own forward has 1 + DFLASH_DRAFT_DEPTH query rows per request
    whatever the target's: its FULL graphs need those batch sizes too (without them V2
    runs a batch's draft round eagerly). A step schedules at most a prompt and the
    largest decode step at ``reserved_len`` = 1 + num_speculative_tokens tokens a request,
    the most vLLM's scheduler charges one (at 1024 + 512 tokens the rule engine of k = 64
    ran 23 of 32 requests, H100, 2026-12-07; 1536 / 65 = 23.6). Model runner
    V2's warm-up then verifies up to max_num_seqs requests of 1 + k rows, a group of
    requests at a time (``VERIFY_CHUNK_BYTES``: before it, 32 requests of 65 rows ran an
    H100 out of memory)."""
    max_model_len = max(shapes.contexts) + 1024
    batches = shapes.batches + (shapes.long_batches or ())
    fixed = shapes.memory_bytes is not None
    common = dict(max_model_len=max_model_len, skip_tokenizer_init=True,
                  disable_log_stats=False)
    if fixed:
        common.update(max_num_seqs=max(batches), kv_cache_memory_bytes=shapes.memory_bytes)
    if shapes.name == "tiny":
        from vllm_tfm.tiny.engine_runs import CPU_ENGINE_KWARGS

        return {**CPU_ENGINE_KWARGS, **common}
    from vllm_tfm.tiny.gpu_checks import CUDA_GRAPH_SETTINGS, ENGINE_KWARGS

    graphs = CUDA_GRAPH_SETTINGS[GRAPH_SETTING[shapes.compilation]]
    engine = {**ENGINE_KWARGS, **graphs, **common, "load_format": "dummy"}
    if not fixed:  # the harness's settings kept, vLLM's memory and scheduling defaults
        for name in ("max_num_seqs", "kv_cache_memory_bytes", "gpu_memory_utilization"):
            engine.pop(name, None)
        if shapes.max_num_seqs is not None:
            engine["max_num_seqs"] = shapes.max_num_seqs
        compilation = dict(graphs["compilation_config"])
        compilation.pop("max_cudagraph_capture_size", None)
        return {**engine, "compilation_config": compilation}
    sizes = sorted({b * m for b in batches for m in (1, 1 + DFLASH_DRAFT_DEPTH, *query_lens(b))})
    compilation = {**graphs["compilation_config"], "cudagraph_capture_sizes": sizes,
                   "max_cudagraph_capture_size": sizes[-1]}
    return {**engine, "compilation_config": compilation,
            "max_num_batched_tokens": max(shapes.contexts) + max(sizes[-1], max(batches) * reserved_len),
            "gpu_memory_utilization": 0.95}


def _engine_core(llm):
    return llm.llm_engine.engine_core.engine_core


def _runner_class(worker) -> str:
    runner = model_runner_of(worker)
    return f"{type(runner).__module__}.{type(runner).__name__}"


def _compiled_variants(worker) -> list[str]:
    from triton_ops.testing import compiled_variants

    return compiled_variants()


def _set_tree(worker, tree: str, budget: int | None) -> bool:
    """The benchmark's switch (see vllm_glue/proposer.py): this tree kind, and either one
    budget for every batch or (None) the engine's own budget rule; then the proposer
    builds the draft rounds the new setting picks (CUDA graphs, captured here between
    measurements while no step runs; kept for later switches), so every setting drafts
    as a served engine of that setting would. False where the runner cannot switch: model
    runner V2's tree speculator drafts the tree kind and budget rule it was started with
    (vLLM's batch-size schedule and its graphs are fixed per engine), so there a budget
    is measured on an engine of that tree kind pinned to it and the rule on an engine of
    its own (``engine_budgets``)."""
    runner = model_runner_of(worker)
    if not hasattr(runner, "drafter"):
        options = runner.speculator.options
        pinned = options.budget_by_batch == ((MAX_BATCH, options.budget),)
        if budget is None:
            return tree == options.tree and not pinned
        return tree == options.tree and budget == options.budget and pinned
    drafter = runner.drafter
    if not hasattr(drafter, "bench_options"):
        drafter.bench_options = drafter.options
    # None: the engine's own rule (under FULL graphs the runner pinned it to the full budget).
    table = drafter.bench_options.budget_by_batch if budget is None else ((MAX_BATCH, budget),)
    drafter.options = dataclasses.replace(drafter.bench_options, tree=tree,
                                          budget_by_batch=table)
    drafter.prepare_rounds()
    return True


def memory_capacity(llm, contexts: tuple[int, ...]) -> dict:
    """Concurrent requests of each context length that fit the engine's KV / state
    allocation (vLLM's own arithmetic, ``get_max_concurrency_for_kv_cache_config``, at that
    length), and what one request holds per KV-cache group."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    config = _engine_core(llm).scheduler.kv_cache_config
    vllm_config = llm.llm_engine.vllm_config
    result = {"num_blocks": config.num_blocks, "groups": []}
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        result["groups"].append({
            "kind": type(spec).__name__, "layers": len(group.layer_names),
            "page_bytes": spec.page_size_bytes,
            "speculative_blocks": getattr(spec, "num_speculative_blocks", None)})
    result["concurrency"] = {}
    for context in contexts:
        at_length = copy.copy(vllm_config)
        model_config = copy.copy(vllm_config.model_config)
        object.__setattr__(model_config, "max_model_len", context)
        object.__setattr__(at_length, "model_config", model_config)
        result["concurrency"][str(context)] = get_max_concurrency_for_kv_cache_config(
            at_length, config)
    return result


# -- measuring -------------------------------------------------------------------------

def scheduler_charges(scheduler) -> dict:
    """What vLLM's scheduler holds when it admits no more requests: its running and waiting
    counts, how many running requests ask the next step for how many tokens (its own
    ``num_new_tokens`` before the budget caps it: the query plus the draft placeholders),
    the async scheduler's placeholders a request (None: a synchronous scheduler) and the
    step's token budget."""
    charged = collections.Counter(r.num_tokens_with_spec + r.num_output_placeholders - r.num_computed_tokens
                                  for r in scheduler.running)
    placeholders = getattr(scheduler, "_spec_token_placeholders", None)
    return {"running": len(scheduler.running), "waiting": len(scheduler.waiting),
            "charged_tokens": sorted(charged.items()),
            "draft_placeholders": None if placeholders is None else len(placeholders),
            "max_num_batched_tokens": scheduler.scheduler_config.max_num_batched_tokens}


class Session:
    """One engine's requests, stepped by hand (``LLMEngine.step``)."""

    def __init__(self, llm, vocab_size: int, temperature: float = 0.0, seed: int = 0):
        self.llm, self.engine = llm, llm.llm_engine
        self.vocab_size = vocab_size
        self.temperature = temperature
        self.random = random.Random(seed)
        self.running: list[str] = []
        self.generated: dict[str, int] = {}
        self.counter = 0
        # scheduler_charges when the last prefill stalled and aborted requests, else None.
        self.stalled_at: dict | None = None

    def add(self, count: int, context: int, max_tokens: int) -> None:
        from vllm import SamplingParams

        for _ in range(count):
            req_id = f"r{self.counter}"
            params = SamplingParams(temperature=self.temperature, max_tokens=max_tokens,
                                    ignore_eos=True, detokenize=False,
                                    seed=self.counter if self.temperature > 0 else None)
            self.counter += 1
            ids = [self.random.randrange(4, self.vocab_size) for _ in range(context)]
            self.engine.add_request(req_id, {"prompt_token_ids": ids}, params)
            self.running.append(req_id)
            self.generated[req_id] = 0

    def step(self) -> float:
        """One engine step; its wall seconds."""
        started = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - started
        for output in outputs:
            self.generated[output.request_id] = len(output.outputs[0].token_ids)
            if output.finished and output.request_id in self.running:
                self.running.remove(output.request_id)
        return seconds

    def prefill(self) -> None:
        """Step until every request has its first token; requests the KV / state memory
        cannot admit (the scheduler keeps them waiting while every admitted one decodes)
        are aborted, so a batch is what the engine can run at once."""
        scheduler = _engine_core(self.llm).scheduler
        stalled = 0
        self.stalled_at = None
        while any(self.generated[r] == 0 for r in self.running):
            self.step()
            started = sum(self.generated[r] > 0 for r in self.running)
            stalled = stalled + 1 if scheduler.waiting and started == len(scheduler.running) else 0
            if stalled >= 2:
                self.stalled_at = scheduler_charges(scheduler)
                waiting = [r for r in self.running if self.generated[r] == 0]
                self.running = [r for r in self.running if self.generated[r] > 0]
                self.engine.abort_request(waiting)

    def keep(self, count: int) -> None:
        drop, self.running = self.running[count:], self.running[:count]
        if drop:
            self.engine.abort_request(drop)

    def close(self) -> None:
        self.keep(0)
        while self.engine.has_unfinished_requests():
            self.engine.step()


def measure_cell(session: Session, steps: int) -> dict:
    """``steps`` engine steps after one discarded step: medians of the period and phases."""
    llm = session.llm
    session.step()
    before = sum(session.generated[r] for r in session.running)
    batch = len(session.running)
    llm.collective_rpc(set_recording, args=(True,))
    with ClockSampler() as clocks:
        periods = [session.step() * 1e3 for _ in range(steps)]
    llm.collective_rpc(set_recording, args=(False,))
    rows = llm.collective_rpc(collect_steps)[0]
    tokens = sum(session.generated[r] for r in session.running) - before
    decode = [row for row in rows if row["decode"]]
    cell = {"batch": batch, "steps": len(periods), "decode_steps": len(decode),
            "period_ms": statistics.median(periods),
            "observed_tokens_per_step": tokens / max(1, len(periods)) / max(1, batch),
            **phase_medians(decode)}
    if decode:
        cell["rest"] = cell["period_ms"] - sum(cell[name] for name in PHASES)
    cell["graphs"] = graph_dispatch(decode)
    cell["clocks"] = clocks.summary
    return cell


def graph_dispatch(steps: list[dict]) -> str | None:
    """How many of ``steps`` dispatched each (role, CUDA-graph mode), e.g. "drafting FULL
    10/10, target FULL 10/10" (None where the runner records none: V1): a cell whose steps
    ran eagerly is not the graphed step time it would otherwise be read as."""
    modes = collections.Counter(label for step in steps for label in step["graphs"])
    return ", ".join(f"{label} {count}/{len(steps)}"
                     for label, count in sorted(modes.items())) or None


def profile_cell(session: Session, steps: int, path: Path) -> None:
    """``steps`` engine steps of the session's cell profiled (``profile_engine``), with
    the Triton variants of our kernels compiled so far."""
    variants = session.llm.collective_rpc(_compiled_variants)[0]
    extra = ("\nTriton variants of our kernels compiled in the engine's process so far (cache "
             "key: argument specialisation, constexprs; registers, spills):\n"
             + "\n".join(variants) + "\n")
    profile_engine(session.llm, lambda: [session.step() for _ in range(steps)], path, extra)


def engine_budgets(settings, budgets: tuple[int, ...],
                   runner: str = "v1") -> list[tuple[int, bool, str, list]]:
    """dflash_tfm's engines: (num_speculative_tokens, whether the engine drafts by its
    budget rule, the tree kind it starts with, the settings it measures); the order is
    the settings' (the issue's targets first). On V1 the proposer switches tree kinds
    between measurements, and vLLM replays FULL graphs only for trees of
    num_speculative_tokens drafts: one engine per budget, started with Weaver; the engine
    of the largest budget also measures the budget rule (whose smaller trees run eagerly
    there). On V2 an engine drafts the tree kind it was started with, and the rule is
    vLLM's batch-size schedule, graphed at the k it picks at each batch size only
    (vllm_glue/v2/graph_pruning.py): the rule gets an engine of the largest budget of its
    own, and every (tree kind, budget) an engine pinned to it."""
    largest = max(budgets)
    by_engine: dict[tuple[int, bool, str], list] = {}
    for tree, budget in settings:
        if runner != "v2":
            key = (largest if budget is None else budget, False, "weaver")
        elif budget is None:
            key = (largest, True, tree)
        else:
            key = (budget, False, tree)
        by_engine.setdefault(key, []).append((tree, budget))
    return [(budget, rule, tree, group) for (budget, rule, tree), group in by_engine.items()]


def engine_note(entry: dict) -> str:
    """The label suffix of an engine (or its rows) that turned async scheduling off or
    set Weaver's expand width."""
    note = ", sync scheduling" if entry.get("sync_scheduling") else ""
    if entry.get("expand_width"):
        note += f", width {entry['expand_width']}"
    return note


def engine_label(result: dict) -> str:
    budget = result.get("engine_budget")
    if budget is None:
        return result["method"]
    rule = ", rule" if result.get("engine_rule") else ""
    tree = f" {result['engine_tree']}" if result.get("engine_tree") else ""
    return f"{result['method']}{tree} (k = {budget}{rule}{engine_note(result)})"


def run_method(method: str, models: dict, shapes: Shapes, runner: str, settings,
               deadline: float, log, budget: int | None = None,
               profile_dir: Path | None = None, rule_engine: bool = False,
               tree: str | None = None, tfm_sync_scheduling: bool = False,
               memory_dir: Path | None = None) -> dict:
    """One engine for ``method`` (for dflash_tfm: of num_speculative_tokens ``budget``,
    started with tree kind ``tree``; on V2 pinned to it, or with ``rule_engine`` drafting
    by the default budget rule; with ``tfm_sync_scheduling`` turning async scheduling off;
    otherwise every engine runs vLLM's default, async on V2):
    every context, batch (smallest first) and, for dflash_tfm, every (tree, budget)
    setting; the engine's memory capacity. With ``profile_dir``, the engine's first cell
    at each batch size is also profiled (``profile_cell``) into a file there; with
    ``memory_dir``, where its start-up's GPU memory goes (``memory_trace``) likewise."""
    import torch
    from vllm import LLM

    from vllm_tfm.tiny.gpu_checks import select_runner

    # dflash_tfm's config wrapper still picks V1 for itself where it must: each engine's
    # result names the runner class it got.
    select_runner(runner)
    started = time.perf_counter()
    max_budget = budget or DFLASH_DRAFT_DEPTH
    fixed_lens = {PLAIN: (1,), VLLM_DFLASH: (1 + DFLASH_DRAFT_DEPTH,)}.get(method, (1 + max_budget,))
    query_lens = lambda batch: fixed_lens  # noqa: E731
    table = None
    if method == TFM and runner == "v2":
        if rule_engine:  # the default rule, given (V2 opts in by a table); its k graphed
            table = default_budget_table(max_budget)
            query_lens = lambda batch: (1 + rule_budget(max_budget, batch),)  # noqa: E731
        else:
            table = ((MAX_BATCH, max_budget),)
    sync = method == TFM and tfm_sync_scheduling
    width = shapes.expand_width if method == TFM else None
    result = {"method": method, "engine_budget": budget, "engine_rule": rule_engine,
              "engine_tree": tree if method == TFM and runner == "v2" else None,
              "sync_scheduling": sync, "expand_width": width}
    tracing = contextlib.nullcontext()
    if memory_dir is not None:
        name = profile_file_name(engine_label(result))
        tracing = trace_engine_start(memory_dir / f"memory_{name}.txt")
    with tracing:
        llm = LLM(model=models["target"],
                  speculative_config=speculative_config(method, models, max_budget, table,
                                                        width, tree),
                  **engine_kwargs(shapes, runner, query_lens, max(fixed_lens)),
                  **({"async_scheduling": False} if sync else {}))
    result |= {"start_s": time.perf_counter() - started, "cells": [],
              "memory": memory_capacity(llm, shapes.contexts)}
    log(f"{engine_label(result)}: engine up in {result['start_s']:.0f} s; "
        f"memory {result['memory']}")
    result["runner_class"] = llm.collective_rpc(_runner_class)[0]
    llm.collective_rpc(install_on_worker, args=(runner,))
    session = Session(llm, models["vocab_size"], shapes.temperature)
    profiled: set[int] = set()  # batch sizes whose first cell was profiled
    try:
        for context in sorted(shapes.contexts):
            if time.perf_counter() > deadline:
                result["skipped"] = f"context {context} and after: deadline"
                break
            room = llm.llm_engine.vllm_config.model_config.max_model_len - context - 64
            # Smallest batch first (the issue's targets are at batch 1): each larger batch
            # adds requests to the running ones; the memory may admit fewer.
            measured = 0
            for batch in sorted(shapes.batches_at(context)):
                session.add(batch - len(session.running), context,
                            max_tokens=room - max_budget)
                session.prefill()
                if session.stalled_at is not None:
                    log(f"  {batch} requests asked, {len(session.running)} admitted; the scheduler "
                        f"then: {session.stalled_at}")
                if len(session.running) == measured:
                    break  # the memory admits no more requests
                measured = len(session.running)
                for tree, budget in settings if method == TFM else [(None, None)]:
                    if time.perf_counter() > deadline:
                        result.setdefault("skipped", f"from context {context} batch {batch}")
                        break
                    if tree is not None and not llm.collective_rpc(
                            _set_tree, args=(tree, budget))[0]:
                        log(f"  {tree} {budget or 'rule'}: not measured, model runner "
                            f"{runner} drafts only the engine's own tree")
                        continue
                    cell = {"context": context, "tree": tree, "budget": budget,
                            "requested_batch": batch, "stalled_at": session.stalled_at,
                            **measure_cell(session, shapes.steps)}
                    result["cells"].append(cell)
                    phases = ", ".join(f"{name} {_f(cell[name])}" for name in PHASES)
                    setting = f"{tree} {budget or 'rule'}" if tree else ""
                    log(f"  {method} ctx {context} B {cell['batch']} {setting}: period "
                        f"{cell['period_ms']:.2f} ms ({phases})")
                    if profile_dir is not None and cell["batch"] not in profiled:
                        profiled.add(cell["batch"])
                        name = profile_file_name(engine_label(result))
                        path = profile_dir / f"profile_{name}_B{cell['batch']}.txt"
                        profile_cell(session, shapes.steps, path)
                        log(f"  profiled {shapes.steps} steps of that cell: {path}")
            session.close()
    finally:
        # The session holds the engine too: both go before the cleanup, or the next
        # engine starts beside this one's memory.
        del llm, session
        import gc

        gc.collect()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return result


# -- projection and report -------------------------------------------------------------

def ours_taus(temperature: float = 0.0,
              path: Path = OURS_ACCEPTANCE) -> dict[tuple[str, int], float]:
    """(tree kind, budget) -> tau of the trained tiny family at ``temperature`` (none
    where it was not measured); the chain's under budget 15."""
    data = json.loads(path.read_text())
    taus = {}
    for row in data["results"]:
        if row["temperature"] == temperature:
            kind = {v: k for k, v in EVAL_METHODS.items()}[row["method"]]
            taus[(kind, row["budget"])] = row["tau"]
    return taus


def stated_tau(regime: str, tree: str | None, budget: int, ours: dict) -> float | None:
    """tau of a configuration: regime "paper-4" / "paper-5" (chain tau 4 / 5 and the
    paper's ratios, budget 64 only) or "ours" (the trained tiny family; budget 127 takes
    the measured 128). ``tree`` None is a chain (vLLM dflash)."""
    tree = tree or "chain"
    if regime.startswith("paper"):
        chain = float(regime.split("-")[1])
        if tree == "chain":
            return chain
        ratio = PAPER_RATIO_TO_CHAIN.get((tree, budget))
        return None if ratio is None else chain * ratio
    if tree == "chain":
        return ours.get(("chain", DFLASH_DRAFT_DEPTH))
    return ours.get((tree, 128 if budget == MAX_BUDGET else budget))


REGIMES = (*(f"paper-{tau:g}" for tau in PAPER_CHAIN_TAUS), "ours")


def rule_budget(max_budget: int, batch: int) -> int:
    return TfmOptions(budget=max_budget).step_budget(batch)


def project(results: list[dict], ours: dict, max_budget: int) -> list[dict]:
    """One row per measured cell with projected tokens/s per regime and the ratios to
    plain decoding and to vLLM's chain at the same context and batch."""
    cells = [(r["method"], {key: r.get(key) for key in ("sync_scheduling", "expand_width")},
              cell) for r in results for cell in r["cells"]]
    period = {(m, c["context"], c["batch"], c["tree"], c["budget"]): c["period_ms"]
              for m, _, c in cells}
    rows = []
    for method, variant, cell in cells:
        row = {"method": method, **variant, **cell}
        budget = cell["budget"]
        if method == TFM and budget is None:
            budget = rule_budget(max_budget, cell["batch"])
            row["rule_budget"] = budget
        plain = period.get((PLAIN, cell["context"], cell["batch"], None, None))
        chain = period.get((VLLM_DFLASH, cell["context"], cell["batch"], None, None))
        row["x_plain_step"] = cell["period_ms"] / plain if plain else None
        for regime in REGIMES:
            tau = 1.0 if method == PLAIN else stated_tau(regime, cell["tree"], budget, ours)
            tps = None if tau is None else tau * cell["batch"] / cell["period_ms"] * 1e3
            row[f"tok_s {regime}"] = tps
            plain_tps = cell["batch"] / plain * 1e3 if plain else None
            chain_tau = stated_tau(regime, None, DFLASH_DRAFT_DEPTH, ours)
            chain_tps = chain_tau * cell["batch"] / chain * 1e3 if chain and chain_tau else None
            row[f"x_plain {regime}"] = tps / plain_tps if tps and plain_tps else None
            row[f"x_chain {regime}"] = tps / chain_tps if tps and chain_tps else None
        rows.append(row)
    return rows


def _f(value, pattern=".2f") -> str:
    return "-" if value is None else format(value, pattern)


def label(row: dict) -> str:
    if row["method"] != TFM:
        return row["method"]
    if row["budget"] is None:
        return f"dflash_tfm {row['tree']} rule ({row['rule_budget']}{engine_note(row)})"
    return f"dflash_tfm {row['tree']} {row['budget']}{engine_note(row)}"


def batch_label(row: dict) -> str:
    """The measured batch, and the one asked for where the memory admitted fewer."""
    asked = row.get("requested_batch", row["batch"])
    return str(row["batch"]) if asked == row["batch"] else f"{row['batch']} (of {asked})"


def step_table(rows: list[dict]) -> str:
    lines = ["| context | batch | configuration | period ms | x plain step | drafting | "
             "target fwd | verify+commit | rest | tok/s paper tau 4 | x plain | x chain "
             "| tok/s paper tau 5 | x chain | tok/s ours | x plain | x chain "
             "| graph dispatch (decode steps) | SM MHz median / min / max, W |",
             "|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['context']} | {batch_label(row)} | {label(row)} | {_f(row['period_ms'])} "
            f"| {_f(row['x_plain_step'])} | {_f(row['drafting'])} | {_f(row['target forward'])} "
            f"| {_f(row['verify + commit'])} | {_f(row.get('rest'))} "
            f"| {_f(row['tok_s paper-4'], '.1f')} | {_f(row['x_plain paper-4'])} "
            f"| {_f(row['x_chain paper-4'])} | {_f(row['tok_s paper-5'], '.1f')} "
            f"| {_f(row['x_chain paper-5'])} | {_f(row['tok_s ours'], '.1f')} "
            f"| {_f(row['x_plain ours'])} | {_f(row['x_chain ours'])} "
            f"| {row.get('graphs') or '-'} | {clocks_label(row.get('clocks'))} |")
    return "\n".join(lines)


def clocks_label(clocks: dict | None) -> str:
    """The cell's SM clocks and power while it was timed (gpu_clocks), "-" unsampled."""
    if not clocks:
        return "-"
    reasons = f", events {clocks['reasons']}" if clocks["reasons"] else ""
    return (f"{clocks['sm_mhz']:.0f} / {clocks['min_sm_mhz']:.0f} / {clocks['max_sm_mhz']:.0f}, "
            f"{clocks['power_w']:.0f} W{reasons}")


def memory_table(results: list[dict], contexts: tuple[int, ...],
                 memory_bytes: int | None) -> str:
    """Requests that fit ``memory_bytes`` (None: each engine's own KV / state allocation,
    vLLM's defaults) at each context (MiB per request beside, where the budget is fixed),
    GDN state blocks per request and per layer, and the state page (one layer's GDN
    state, conv state included: vLLM sizes its conv window with num_speculative_tokens)."""
    budget = ("vLLM's defaults" if memory_bytes is None
              else f"{memory_bytes / (1 << 30):.2f} GiB of KV / state")
    lines = [f"| method ({budget}) | "
             + " | ".join(f"requests at {c} (MiB each)" for c in contexts)
             + " | GDN state blocks per request and layer | state page MiB |",
             "|---|" + "--:|" * len(contexts) + "--:|--:|"]
    for result in results:
        memory = result["memory"]
        state = [g for g in memory["groups"] if g["speculative_blocks"] is not None]
        per_request = 1 + state[0]["speculative_blocks"] if state else "-"
        page = f"{state[0]['page_bytes'] / (1 << 20):.2f}" if state else "-"
        cells = []
        for context in contexts:
            fits = memory["concurrency"].get(str(context))
            cells.append("-" if fits is None else
                         f"{fits:.1f}" + ("" if memory_bytes is None else
                                          f" ({memory_bytes / fits / (1 << 20):.0f})"))
        lines.append(f"| {engine_label(result)} | " + " | ".join(cells)
                     + f" | {per_request} | {page} |")
    return "\n".join(lines)


def best_budgets(rows: list[dict], regime: str = "ours") -> dict[str, dict[int, int]]:
    """Per context, the measured fixed budget (Weaver) with the most projected tokens/s at
    each batch: the data for a ``budget_by_batch`` table."""
    best: dict[str, dict[int, tuple[float, int]]] = {}
    for row in rows:
        if row["method"] != TFM or row["tree"] != "weaver" or row["budget"] is None:
            continue
        tps = row[f"tok_s {regime}"]
        if tps is None:
            continue
        cell = best.setdefault(str(row["context"]), {})
        if row["batch"] not in cell or tps > cell[row["batch"]][0]:
            cell[row["batch"]] = (tps, row["budget"])
    return {ctx: {b: v[1] for b, v in sorted(cell.items())} for ctx, cell in best.items()}


def report(results: list[dict], shapes: Shapes, header: str, out: Path) -> str:
    ours = ours_taus(shapes.temperature)
    rows = project(results, ours, max(shapes.budgets))
    text = "\n\n".join([
        header, PROJECTION_NOTE,
        "tau stated: paper-4 / paper-5 = chain 4 / 5, Weaver(64) 1.77x and DDTree(64) 1.34x "
        "the chain (no paper tau for other budgets); ours = the trained tiny family at "
        f"T = {shapes.temperature:g}, the requests' temperature (BENCHMARKS.md, Mean "
        "accepted length; budget 127 takes its 128).",
        step_table(rows),
        memory_table(results, shapes.contexts, shapes.memory_bytes),
        "Best measured Weaver budget by batch (tau ours): "
        + json.dumps(best_budgets(rows)),
    ])
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_speed.md").write_text(text + "\n")
    (out / "bench_speed.json").write_text(json.dumps(
        {"header": header, "shapes": dataclasses.asdict(shapes), "results": results,
         "rows": rows}, indent=1))
    return text


def merge_reports(paths: list[Path], out: Path) -> str:
    """One report from several runs' bench_speed.json (e.g. device calls that measured
    different methods): each method's result from the last file that measured it."""
    saved = [json.loads(Path(path).read_text()) for path in paths]
    by_engine: dict[str, dict] = {}
    for run_data in saved:
        for result in run_data["results"]:
            if result.get("memory"):
                by_engine[engine_label(result)] = result
    shapes = Shapes(**{k: tuple(v) if isinstance(v, list) else v
                       for k, v in saved[-1]["shapes"].items()})
    contexts = sorted({c for run_data in saved for c in run_data["shapes"]["contexts"]})
    shapes = dataclasses.replace(shapes, contexts=tuple(contexts))
    header = "\n".join(f"- {run_data['header']}" for run_data in saved)
    order = (PLAIN, VLLM_DFLASH, TFM)
    results = sorted(by_engine.values(), key=lambda r: (order.index(r["method"]),
                                                        r.get("engine_budget") or 0))
    return report(results, shapes, "Merged runs:\n" + header, out)


def _logger(started: float):
    """A log printing seconds since ``started`` (a ``time.perf_counter`` value: the
    monotonic clock, the same in the engines' own processes)."""
    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {message}", flush=True)
    return log


def _prepare_process() -> None:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    from vllm_tfm.vllm_glue import register

    register()  # the harness has no installed entry point


def _run_method_here(started: float, args: tuple, kwargs: dict) -> dict:
    _prepare_process()
    return run_method(*args, log=_logger(started), **kwargs)


def run_method_in_own_process(started: float, *args, **kwargs) -> dict:
    """``run_method`` in a fresh process, whose exit frees all the engine's GPU memory:
    under Inductor, vLLM's shutdown left 9 GiB of an H100 held and the next engine refused
    to start (2026-12-05)."""
    import concurrent.futures
    import multiprocessing

    # Its workers are not daemons, so vLLM may start processes of its own.
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run_method_here, started, args, kwargs).result()


def run(shapes: Shapes, runner: str, methods: tuple[str, ...], trees: tuple[str, ...],
        out: Path, work: Path, deadline_s: float, profile: bool = False,
        rule_only: bool = False, tfm_sync_scheduling: bool = False,
        own_processes: bool | None = None, memory_trace: bool = False) -> str:
    """Every method's engine in turn (plain first: the others are compared with it); the
    report is rewritten after each. ``profile``: each engine's first cell at each batch
    size profiled too. ``rule_only``: dflash_tfm by its batch-size-aware rule alone (the
    engine a user gets), no engine pinned to a budget. ``tfm_sync_scheduling``: the
    dflash_tfm engines turn async scheduling off (``run_method``). ``memory_trace``: each
    engine's start-up memory by window and frame into OUT/memory_<engine>.txt (CUDA
    only). ``own_processes``:
    each engine in a process of its own (``run_method_in_own_process``; default: on CUDA
    under Inductor, whose engines leave memory held; engines sharing a process share its
    warm state: the first engine's profile run took 97 s of an H100, the next 5, 2026-12-05)."""
    _prepare_process()
    import torch

    import vllm

    started = time.perf_counter()
    if own_processes is None:
        own_processes = torch.cuda.is_available() and shapes.compilation == "inductor"
    out.mkdir(parents=True, exist_ok=True)  # profiles are written before the first report
    models = write_qwen36_models(work) if shapes.name != "tiny" else tiny_models()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    engines_note = ("one dflash_tfm engine per tree kind and budget; the rule's own engine, "
                    "vLLM's batch-size schedule, its k graphed" if runner == "v2"
                    else "one dflash_tfm engine per budget, the rule's smaller trees eager")
    graphs = ("eager" if shapes.name == "tiny"
              else f"{COMPILATION_NOTE[shapes.compilation]} + FULL_DECODE_ONLY graphs "
                   f"(tree steps of full trees graphed, {engines_note})")
    header = (f"bench_speed {shapes.name} on {device}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: vLLM {vllm.__version__}, "
              f"torch {torch.__version__}, model runner {runner}, {graphs}; "
              f"{shapes.steps} measured steps per cell (median); requests at temperature "
              f"{shapes.temperature:g}")

    log = _logger(started)
    engines = [(method, None, False, None, None) for method in methods if method != TFM]
    if TFM in methods:
        engines += [(TFM, *engine) for engine
                    in engine_budgets(tfm_settings(trees, shapes.budgets, rule_only),
                                      shapes.budgets, runner)]
    results: list[dict] = []
    text = ""
    for method, budget, rule, tree, settings in engines:
        if time.perf_counter() - started > deadline_s:
            results.append({"method": method, "engine_budget": budget, "skipped": "deadline",
                            "cells": [], "memory": None})
            continue
        try:
            engine = (method, models, shapes, runner, settings, started + deadline_s)
            options = dict(budget=budget, profile_dir=out if profile else None,
                           rule_engine=rule, tree=tree,
                           tfm_sync_scheduling=tfm_sync_scheduling,
                           memory_dir=out if memory_trace else None)
            results.append(run_method_in_own_process(started, *engine, **options)
                           if own_processes else run_method(*engine, log=log, **options))
        except Exception as error:  # keep the other engines' numbers
            import traceback

            traceback.print_exc()
            results.append({"method": method, "engine_budget": budget,
                            "error": f"{type(error).__name__}: {error}", "cells": [],
                            "memory": None})
        text = report([r for r in results if r["memory"]], shapes, header, out)
    failed = [f"{engine_label(r)}: {r['error']}" for r in results if "error" in r]
    return text + ("\n\nFAILED: " + "; ".join(failed) if failed else "")
