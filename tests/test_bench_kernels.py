"""tools/bench_kernels.py end to end on CPU (``--smoke``: every family and sweep at tiny
shapes in Triton's interpreter). A device call runs the tool as it is, so a crash costs
device time: here every family's checks run, and the tables it saves are the ones the GPU
fills."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_checks_every_family_and_saves_its_tables(tmp_path):
    out = tmp_path / "kernels.md"
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_kernels.py"), "--smoke", "--sweep",
         "--variants", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = out.read_text()
    assert text.rstrip().endswith("all checks ok")
    # The one-launch commits: timed beside the per-layer ones (and per commit tile), checked
    # bit for bit.
    assert "commit, one launch" in text and "a launch per layer, and all in one launch" in text
    assert text.count("conv commit, 2 layers in one launch") == 6
    assert "Triton variants compiled (ours):" in text
    # The dense part of a tree forward: F.linear checked at every token count, then tabled.
    assert "F.linear bf16, M=520" in text and "linear layers by token count M" in text
    # The merge kernel's column split: one, two and three programs per row block, checked.
    assert "merge kernel's value columns per program" in text


def test_smoke_tile_sweep_times_each_key_chunk(tmp_path):
    """The peeled tile kernel's sweep (the GPU's next question at 65 x 1): BV x warps, the
    K-chunk rows and the state parts in three dots, each checked against the default path."""
    out = tmp_path / "sweep.md"
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_kernels.py"), "--smoke", "--only", "gdn",
         "--gdn-sections", "sweep", "--sweep", "--sweep-kernel", "peeled_tile", "--skip-baselines",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split() for line in out.read_text().splitlines() if line.split()[:2] == ["17", "1"]]
    # Smoke shapes have K = 32: every chunk asked for runs as one chunk of 32. The default
    # and K-chunk rows at 4 warps (a peeled kernel takes no more), then three dots at 4.
    assert [tuple(row[2:4] + row[6:8]) for row in rows] == [("32", "4", "32", "one")] * 2 + [
        ("32", "4", "32", "three")]
    assert out.read_text().rstrip().endswith("all checks ok")


def test_attention_profile_launches_the_engines_split_and_merge(monkeypatch):
    """``--profile-attn`` (run under ncu on the GPU) launches the engine's tree attention
    kernels: here at tiny heads and prefixes, on CPU."""
    import importlib.util

    import torch

    from triton_ops.testing import recording_launches

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "tools" / "bench_kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with recording_launches() as launches:
        lines = bench.attention_launches_for_profiler(torch.device("cpu"), ((1, 9, 40), (2, 5, 17)),
                                                      (4, 2, 32))
    names = [fn.__name__ for fn, _, _ in launches]
    assert names == ["_tree_attention_split_kernel", "_tree_attention_merge_kernel"] * 4, names
    assert "twice each" in lines[0]
