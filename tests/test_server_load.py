"""vLLM's OpenAI server under dflash_tfm, on loopback, on the trained tiny family.

One server for the module: a fault injected into one request's tree commit fails that
request alone (HTTP 500, vLLM's answer to finish_reason "error") while the requests
batched with it complete; and a load of 64 concurrent requests of every kind (streaming
or not, greedy or sampled, stop strings, n > 1, a quarter aborted mid-stream) leaves the
server as it found it: the same greedy requests give the same tokens, /health answers
200 and vLLM's metrics count nothing running or waiting.
The fault reaches the server's engine-core process through tests/process_hooks.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from test_engine import tfm_config
from vllm_tfm.tiny.engine_runs import (
    CPU_SERVER_ARGS, PROMPTS, TIE_MARGIN, free_port, running_server,
)
from vllm_tfm.tiny.family import trained_family

pytestmark = pytest.mark.engine

HOOKS = Path(__file__).parent / "process_hooks"
# The one prompt whose first tree commit fails (no other request starts with it).
VICTIM_PROMPT = "def fault_injected_here(request):\n"
MAX_TOKENS = 16
LOAD = 64
# Rounds of the fault scenario until the hook fires (see the fault test).
FAULT_ATTEMPTS = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, model name, its log file) of a running server; stopped after the
    module."""
    from transformers import AutoTokenizer

    family = trained_family()
    tokenizer = AutoTokenizer.from_pretrained(str(family.target), local_files_only=True)
    victim_ids = tokenizer(VICTIM_PROMPT)["input_ids"]
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(family.target), *CPU_SERVER_ARGS, "--max-num-seqs", str(LOAD),
        "--host", "127.0.0.1", "--port", str(port),
        "--speculative-config", json.dumps(tfm_config(family, "weaver", 16)),
    ]
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(HOOKS), *filter(None, [os.environ.get(
               "PYTHONPATH")])]),
           "TFM_HOOK_FAIL": json.dumps({"stage": "commit", "rank": 0, "prompt": victim_ids})}
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(command, port, log_path, start_timeout_s=300, env=env) as base:
        yield base, str(family.target), log_path


def tree_faults(log_path: Path) -> list[str]:
    """The faults the tree path logged in the server (runner.py's _report_fault)."""
    return [line for line in log_path.read_text(errors="replace").splitlines()
            if "dflash_tfm: " in line and " failed for requests " in line]


def _complete(base: str, body: dict):
    import httpx

    return httpx.post(f"{base}/v1/completions", json=body, timeout=300)


def _greedy_body(model: str, prompt: str) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 2}


def _greedy(base: str, model: str, prompt: str) -> dict:
    """tokens and top-2 margins of one greedy completion."""
    response = _complete(base, _greedy_body(model, prompt))
    assert response.status_code == 200, response.text
    return _greedy_choice(response.json()["choices"][0])


def _greedy_choice(choice: dict) -> dict:
    margins = []
    for position in choice["logprobs"]["top_logprobs"]:
        best = sorted(position.values(), reverse=True)
        # Two ids that decode to the same text share one entry: no margin is known.
        margins.append(best[0] - best[1] if len(best) > 1 else 0.0)
    return {"tokens": choice["token_ids"], "margins": margins}


def test_a_fault_fails_its_request_with_http_500_and_the_batch_completes(server):
    """The victim decodes trees when the bystanders arrive; the commit of the step that
    holds the victim's tree and their prompts raises. The commit was writing the
    victim's caches, not theirs (their prompt state comes from the forward): the victim
    alone gets HTTP 500, they complete as they would alone, and the server serves on."""
    base, model, log_path = server
    bystanders = PROMPTS[:3]
    alone = [_greedy(base, model, prompt) for prompt in bystanders]
    # The hook fires in a step where the victim has a tree and a bystander prefills. The
    # scheduler decides which step a bystander's prefill lands in; where it lands beside
    # a draftless victim step, or after the victim finished, nothing fires and the victim
    # completes: the scenario runs again (the hook stays armed until it fires).
    for _ in range(FAULT_ATTEMPTS):
        victim, others = _victim_beside(base, model, bystanders)
        for response, expected in zip(others, alone):
            assert response.status_code == 200, response.text
            # Batched with others, bf16 sums may round differently: equal up to a tie.
            _assert_same_up_to_ties(expected, _greedy_choice(response.json()["choices"][0]))
        if victim.status_code != 200 or tree_faults(log_path):
            break
    assert victim.status_code == 500, victim.text
    assert _greedy(base, model, bystanders[0])["tokens"] == alone[0]["tokens"]
    faults = tree_faults(log_path)
    assert len(faults) == 1 and "committing the accepted paths" in faults[0], faults


def _victim_beside(base: str, model: str, bystanders: list[str]):
    """The victim's response and the bystanders', sent once the victim decodes."""
    generated = _metric(base, "vllm:generation_tokens_total")
    with ThreadPoolExecutor(1 + len(bystanders)) as pool:
        victim = pool.submit(_complete, base, {**_greedy_body(model, VICTIM_PROMPT),
                                               "max_tokens": 256})
        deadline = time.monotonic() + 60
        while _metric(base, "vllm:generation_tokens_total") < generated + 8:
            assert time.monotonic() < deadline and not victim.done(), "the victim did not decode"
            time.sleep(0.2)
        others = list(pool.map(lambda p: _complete(base, _greedy_body(model, p)), bystanders))
        return victim.result(), others


def _assert_same_up_to_ties(expected: dict, got: dict) -> None:
    differs = [i for i, (a, b) in enumerate(zip(expected["tokens"], got["tokens"])) if a != b]
    assert len(got["tokens"]) == len(expected["tokens"])
    if differs:
        first = differs[0]
        assert expected["margins"][first] < TIE_MARGIN, (
            f"greedy output differs at token {first} where the top-2 margin is "
            f"{expected['margins'][first]} (not a bf16 tie)")


def _stream(base: str, body: dict, abort_after: int | None) -> dict:
    """A streaming completion read chunk by chunk; with `abort_after` the client hangs up
    after that many chunks."""
    import httpx

    chunks, finish = [], None
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True},
                      timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            choice = event["choices"][0]
            chunks.append(choice["text"])
            finish = choice.get("finish_reason") or finish
            if abort_after is not None and len(chunks) >= abort_after:
                return {"aborted": True, "text": "".join(chunks)}
    return {"aborted": False, "text": "".join(chunks), "finish_reason": finish}


def _load_requests(model: str) -> list[tuple[str, dict, int | None]]:
    """LOAD requests: (kind, body, abort after this many chunks or None), shuffled. Every
    fourth is aborted; greedy and sampled alternate by fours, stop strings and n = 2 (on
    sampled plain requests) by eights."""
    rng = random.Random(20261202)
    requests = []
    for index in range(LOAD):
        prompt = PROMPTS[index % len(PROMPTS)]
        kind = ("stream", "aborted", "plain", "plain")[index % 4]
        sampled = (index // 4) % 2 == 1
        if kind == "plain" and not sampled:
            body = _greedy_body(model, prompt)
        else:
            body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0.8 if sampled else 0, "seed": index}
        if kind == "aborted":
            # Long enough that hanging up after a few chunks is mid-stream.
            body.update(max_tokens=4 * MAX_TOKENS, ignore_eos=True)
        elif (index // 8) % 2 == 1:
            body["stop"] = ["\n", "):"]
        elif kind == "plain" and sampled:
            body["n"] = 2
        requests.append((kind, body, rng.randint(1, 3) if kind == "aborted" else None))
    rng.shuffle(requests)
    return requests


def _send(base: str, request: tuple[str, dict, int | None]) -> dict:
    kind, body, abort_after = request
    if kind == "plain":
        response = _complete(base, body)
        assert response.status_code == 200, response.text
        return response.json()
    return _stream(base, body, abort_after)


def _metric(base: str, name: str) -> float:
    import httpx

    text = httpx.get(f"{base}/metrics", timeout=30).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{") or line.startswith(name + " ")]
    assert values, f"{name} is not among vLLM's metrics"
    return sum(values)


def test_load_of_concurrent_requests_leaves_the_server_as_it_was(server):
    import httpx

    base, model, log_path = server
    faults = tree_faults(log_path)
    before = {prompt: _greedy(base, model, prompt) for prompt in PROMPTS}
    drafts_before = _metric(base, "vllm:spec_decode_num_drafts_total")
    requests = _load_requests(model)
    kinds = [kind for kind, _, _ in requests]
    assert kinds.count("aborted") == LOAD // 4
    started = time.monotonic()
    with ThreadPoolExecutor(LOAD) as pool:
        results = list(pool.map(lambda request: _send(base, request), requests))
    load_s = time.monotonic() - started

    for (kind, body, _), result in zip(requests, results):
        if kind == "aborted":
            assert result["aborted"]
            continue
        choices = [result] if kind == "stream" else result["choices"]
        assert len(choices) == body.get("n", 1)
        for choice in choices:
            assert choice["finish_reason"] in ("length", "stop"), choice
            if body.get("stop"):
                assert not any(stop in choice["text"] for stop in body["stop"]), choice
            if choice["finish_reason"] == "length" and choice.get("token_ids"):
                assert len(choice["token_ids"]) == MAX_TOKENS
        if kind == "plain" and body["temperature"] == 0 and not body.get("stop"):
            _assert_same_up_to_ties(before[body["prompt"]],
                                    _greedy_choice(result["choices"][0]))

    after = {prompt: _greedy(base, model, prompt) for prompt in PROMPTS}
    assert {p: r["tokens"] for p, r in after.items()} == \
        {p: r["tokens"] for p, r in before.items()}
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 30
    while (_metric(base, "vllm:num_requests_running")
           or _metric(base, "vllm:num_requests_waiting")):
        assert time.monotonic() < deadline, "requests left running or waiting after the load"
        time.sleep(1)
    assert _metric(base, "vllm:spec_decode_num_drafts_total") > drafts_before
    assert tree_faults(log_path) == faults, "the tree path reported faults under load"
    print(f"{LOAD} concurrent requests in {load_s:.1f} s")
