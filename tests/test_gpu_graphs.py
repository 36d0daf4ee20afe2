"""dflash_tfm on a CUDA GPU under vLLM's default compilation settings, as a user starts it.

vLLM captures CUDA graphs by default: its FULL decode graphs are captured with a tree step
active (vllm_glue/tree_graphs.py) and replayed by steps whose trees all have the configured
budget; piecewise graphs hold the chain kernels, so tree steps must never replay them. Runs
`tools/gpu_e2e.py` (one engine per configuration) and requires greedy output equal to no
speculation (up to bf16 ties), every tree kernel to have run (in the captured graphs and the
eager steps), tree steps to have replayed FULL graphs and none a piecewise one. On model runner V2
(vLLM 0.33's GPU default): the baselines (no speculation replays FULL decode graphs, vLLM's
`dflash`, drafter graphed too, is lossless against it) and dflash_tfm through vllm_glue/v2,
eager and under FULL_DECODE_ONLY graphs, with the same checks as on V1. Needs a CUDA GPU and
vLLM importable there: on the H200, through the device tool and tools/gpu_vllm (payload
built with VLLM_VERSION=0.32.0 or 0.33.0; the report's header names the version that ran),

    bash .gpu-vllm/setup.sh && PYTHONPATH=/tmp/vsrc:/tmp/site:$PWD \\
        python3 -m pytest -q -m gpu tests/test_gpu_graphs.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_tfm.tiny.launch_counts import COMMIT_GRAPH_REPLAYS

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _gpu_e2e(*arguments: str) -> int:
    """The tool's exit status; its output streams through (``pytest -s`` shows it)."""
    # conftest turns the Triton interpreter on for the CPU suite: the GPU runs compiled.
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    command = [sys.executable, str(REPO_ROOT / "tools" / "gpu_e2e.py"), *arguments]
    return subprocess.run(command, env={**env, "PYTHONUNBUFFERED": "1"}, timeout=540).returncode


def _run_tiny(tmp_path, *arguments: str) -> tuple[int, str, dict]:
    """Build the tiny models, run ``gpu_e2e.py run`` on them (32 tokens a prompt) with
    ``arguments``: (exit status, the markdown report, the rows by configuration)."""
    models = tmp_path / "models"
    assert _gpu_e2e("build", str(models)) == 0
    status = _gpu_e2e("run", "--models", str(models), "--out", str(tmp_path), "--max-tokens",
                      "32", *arguments)
    report = (tmp_path / "gpu_e2e.md").read_text()
    rows = {row["config"]: row for row in json.loads((tmp_path / "gpu_e2e.json").read_text())}
    return status, report, rows


@pytest.mark.parametrize("cudagraphs", ["default", "full-decode"])
def test_tree_steps_stay_lossless_under_cuda_graphs(tmp_path, cudagraphs):
    status, report, rows = _run_tiny(tmp_path, "--cudagraphs", cudagraphs, "--configs",
                                     "weaver B=64", "ddtree B=33", "vLLM dflash")
    assert status == 0, report
    assert set(rows) == {"no speculation", "dflash_tfm weaver B=64", "dflash_tfm ddtree B=33",
                         "vLLM dflash (chain, 15)"}
    # The baseline itself replayed graphs: the setting is really graphed.
    assert any(count for name, count in rows["no speculation"]["launches"].items()
               if name.startswith("other steps, graph mode F"))
    for label in ("dflash_tfm weaver B=64", "dflash_tfm ddtree B=33"):
        launches = rows[label]["launches"]
        assert launches.get("tree steps, graph mode FULL", 0) > 0, launches
        assert not launches.get("tree steps, graph mode PIECEWISE"), launches
        assert "NOT ties" not in rows[label]["equality"], rows[label]["equality"]
        assert rows[label]["kernels"] == "all ran", rows[label]["kernels"]


def test_model_runner_v2_baselines_replay_full_graphs_losslessly(tmp_path):
    status, report, rows = _run_tiny(tmp_path, "--cudagraphs", "full-decode", "--runner", "v2",
                                     "--configs", "vLLM dflash")
    assert status == 0, report
    assert "model runner V2" in report
    assert set(rows) == {"no speculation", "vLLM dflash (chain, 15)"}
    for label, row in rows.items():
        assert row["launches"].get("other steps, graph mode FULL", 0) > 0, (label, row)
    assert "NOT ties" not in rows["vLLM dflash (chain, 15)"]["equality"]


@pytest.mark.parametrize("cudagraphs", ["off", "full-decode"])
def test_model_runner_v2_tree_steps_are_lossless(tmp_path, cudagraphs):
    status, report, rows = _run_tiny(tmp_path, "--cudagraphs", cudagraphs, "--runner", "v2",
                                     "--configs", "weaver B=7", "ddtree B=7")
    assert status == 0, report
    assert "model runner V2" in report
    assert set(rows) == {"no speculation", "dflash_tfm weaver B=7", "dflash_tfm ddtree B=7"}
    for label in ("dflash_tfm weaver B=7", "dflash_tfm ddtree B=7"):
        row = rows[label]
        assert "NOT ties" not in row["equality"], row["equality"]
        assert row["kernels"] == "all ran", row["kernels"]
        assert row["sampled"]["tokens_per_s"] > 0, row["sampled"]
        if cudagraphs != "off":
            assert row["launches"].get("tree steps, graph mode FULL", 0) > 0, row["launches"]
            # Their commits replay the commit graph of their (size, request count).
            assert row["launches"].get(COMMIT_GRAPH_REPLAYS, 0) > 0, row["launches"]
