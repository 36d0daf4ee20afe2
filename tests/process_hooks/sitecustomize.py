"""Test hooks for engine processes the tests do not run in themselves.

vLLM runs tensor-parallel workers and the OpenAI server's engine core in processes
of their own; Python imports this module at their start when this folder is on
PYTHONPATH, and it acts only where the tests set its environment variables:

TFM_HOOK_RECORD_DIR   each rank appends what its tree path held per step to
                      rank<R>.jsonl: the trees it verifies (a digest) and whether it
                      grew them itself, then the accepted leaves and tokens, and any
                      fault injected below.
TFM_HOOK_FAIL         JSON {"stage": "verify" | "commit", "rank": R, "prompt": [ids]}:
                      that stage raises once, on tensor-parallel rank R, in the first
                      tree step where a request whose prompt starts with those token
                      ids has a tree of more than its root; a commit only where
                      another request of the step prefills (the commit writes no
                      cache of it), so that the fault costs the victim alone.
"""

from __future__ import annotations

import json
import os

_RECORD_DIR = os.environ.get("TFM_HOOK_RECORD_DIR")
_FAIL = json.loads(os.environ["TFM_HOOK_FAIL"]) if os.environ.get("TFM_HOOK_FAIL") else None


def _rank() -> int:
    from vllm.distributed import get_tp_group

    return get_tp_group().rank_in_group


def _record(entry: dict) -> None:
    with open(os.path.join(_RECORD_DIR, f"rank{_rank()}.jsonl"), "a") as log:
        log.write(json.dumps(entry) + "\n")


def _digest(tensor) -> str:
    import hashlib

    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _install_recorder() -> None:
    from vllm_tfm.vllm_glue import proposer, runner

    grow, propose, adopt = (proposer.TreeProposer._grow_trees, proposer.TreeProposer.propose,
                            runner._adopt_first_rank_result)
    grown = []

    def _grow_trees(self, *args, **kwargs):
        grown.append(True)
        return grow(self, *args, **kwargs)

    def propose_and_record(self, *args, **kwargs):
        grown.clear()
        drafts = propose(self, *args, **kwargs)
        trees = self.trees
        _record({"trees": {name: _digest(getattr(trees, name)) for name in
                           ("tokens", "parents", "depths", "num_nodes", "draft_logq")},
                 "grown_here": bool(grown)})
        return drafts

    def adopt_and_record(step, output):
        adopt(step, output)
        _record({"accepted": step.accepted_leaf.tolist(),
                 "tokens": output.sampled_token_ids.tolist()})

    proposer.TreeProposer._grow_trees = _grow_trees
    proposer.TreeProposer.propose = propose_and_record
    runner._adopt_first_rank_result = adopt_and_record


def _victim_has_a_tree(model_runner, step) -> bool:
    prompt = _FAIL["prompt"]
    nodes = step.meta.num_nodes.tolist()
    for row, req_id in enumerate(step.req_ids):
        state = model_runner.requests.get(req_id)
        if state and list(state.prompt_token_ids[: len(prompt)]) == prompt and nodes[row] > 1:
            return True
    return False


def _others_prefill(step) -> bool:
    from vllm_tfm.vllm_glue.commit import written_requests

    return len(written_requests(step)) < len(step.req_ids)


def _install_fault() -> None:
    from vllm_tfm.vllm_glue import commit, verify

    fired = []

    def faulty(original, step_of, when=lambda step: True):
        def stage(model_runner, *args, **kwargs):
            step = step_of(model_runner, *args)
            if (not fired and _rank() == _FAIL["rank"]
                    and _victim_has_a_tree(model_runner, step) and when(step)):
                fired.append(True)
                if _RECORD_DIR:
                    _record({"fault": _FAIL["stage"]})
                raise RuntimeError(f"injected {_FAIL['stage']} fault")
            return original(model_runner, *args, **kwargs)

        return stage

    if _FAIL["stage"] == "verify":
        verify.verify_step = faulty(verify.verify_step, lambda model_runner, step, *_: step)
    elif _FAIL["stage"] == "commit":
        commit.commit_step = faulty(commit.commit_step, lambda model_runner, step: step,
                                    _others_prefill)
    else:
        raise ValueError(f"TFM_HOOK_FAIL['stage'] must be 'verify' or 'commit', got "
                         f"{_FAIL['stage']!r}")


if _RECORD_DIR:
    _install_recorder()
if _FAIL:
    _install_fault()
