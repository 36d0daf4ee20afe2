"""Where an engine's GPU memory goes while it starts: PyTorch's allocator history over
vLLM's memory profile (``Worker.determine_available_memory``) and its warm-up with the
graph captures (``Worker.compile_or_warm_up_model``), each window's allocations grouped
by the frames that made them (the plugin's first, then vLLM's).

For each window: the live bytes at its peak, and of what the window itself allocated, what
was live at that peak and what is still live at its end. The last is what a start-up keeps
beyond its KV cache: it found the GDN commit records that every captured graph size kept
(2.49 GiB at max_num_seqs 8, Qwen3.6-27B shapes on an H100; BENCHMARKS.md, stop 44).
Last, the segments the window reserved from CUDA and still holds at its end, by the frame
whose allocation reserved them: memory a graph pool keeps though nothing in it is live
(vLLM's "CUDA graph pool memory" counts it) shows here and in no allocation.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# Worker methods whose calls are the windows reported.
WINDOWS = ("determine_available_memory", "compile_or_warm_up_model")
# Allocator events kept (a ring buffer): an engine start at 27B shapes makes ~10^5-10^6.
MAX_EVENTS = 5_000_000
GIB = 2**30


@dataclass(frozen=True)
class Window:
    """One window of the allocator's history; byte counts by frame key, largest first."""

    name: str
    peak_bytes: int
    at_peak: list[tuple[str, int]]
    kept: list[tuple[str, int]]
    reserved: list[tuple[str, int]]


def _ours(filename: str) -> bool:
    return ("vllm_tfm" in filename or "triton_ops" in filename) and "benchmarks" not in filename


def frame_key(frames: list[dict], depth: int = 2) -> str:
    """Where an allocation was made: its innermost ``depth`` frames of the plugin, then of
    vLLM (file:line:function, innermost first); other Python frames where neither appears
    (the allocator's C++ frames come first in a trace and say nothing of the caller)."""
    ours = [f for f in frames if _ours(f["filename"])]
    vllm = [f for f in frames if "/vllm/" in f["filename"]]
    python = [f for f in frames if f["filename"].endswith(".py")]
    picked = (ours[:depth] + vllm[:depth]) or python[:depth] or frames[:depth]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}"
                      for f in picked) or "?"


# Allocator trace actions that take memory and give it back: blocks, then CUDA segments
# (mapped pages of expandable segments count as segments).
BLOCK_ACTIONS = ({"alloc"}, {"free_requested"})
SEGMENT_ACTIONS = ({"segment_alloc", "segment_map"}, {"segment_free", "segment_unmap"})


def window(events: list[dict], start: int, name: str) -> Window:
    """The window of allocator ``events`` (``torch.cuda.memory._snapshot()``'s device
    trace: ``action``, ``addr``, ``size``, ``frames``) from index ``start`` on."""
    taken, given = BLOCK_ACTIONS
    seg_taken, seg_given = SEGMENT_ACTIONS
    live: dict[int, tuple[int, dict]] = {}
    segments: dict[int, tuple[int, dict]] = {}
    total = 0
    peak, at_peak = -1, {}
    for index, event in enumerate(events):
        action = event["action"]
        if action in taken:
            live[event["addr"]] = (index, event)
            total += event["size"]
        elif action in given and event["addr"] in live:
            total -= live.pop(event["addr"])[1]["size"]
        elif action in seg_taken:
            segments[event["addr"]] = (index, event)
        elif action in seg_given:
            segments.pop(event["addr"], None)
        if index >= start and total > peak:
            peak, at_peak = total, dict(live)
    if peak < 0:  # nothing happened in the window
        peak, at_peak = total, live

    def grouped(blocks) -> list[tuple[str, int]]:
        sizes = Counter()
        for index, event in blocks:
            if index >= start:
                sizes[frame_key(event.get("frames", []))] += event["size"]
        return sizes.most_common()

    return Window(name, peak, grouped(at_peak.values()), grouped(live.values()),
                  grouped(segments.values()))


def format_window(w: Window, top: int = 12) -> str:
    """The window's report: each section's total over every frame, its ``top`` frames."""
    def gib(rows) -> str:
        return f"{sum(size for _, size in rows) / GIB:.2f} GiB"

    sections = [(f"== {w.name}: {w.peak_bytes / GIB:.2f} GiB live at its peak; of what it "
                 f"allocated, {gib(w.at_peak)} live then, by frame:", w.at_peak),
                (f"   still live at its end: {gib(w.kept)}, by frame:", w.kept),
                (f"   segments it reserved, still held at its end: {gib(w.reserved)}, by the "
                 "frame that reserved them:", w.reserved)]
    lines = []
    for title, rows in sections:
        lines.append(title)
        lines += [f"  {size / GIB:8.3f} GiB  {key}" for key, size in rows[:top]]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def trace_engine_start(path: Path, worker_class=None, top: int = 12):
    """While the block runs, record the CUDA allocator's history and append the report of
    each call of ``worker_class``'s :data:`WINDOWS` methods (vLLM's GPU ``Worker`` by
    default; the engine's worker must run in this process) to ``path`` as the call ends,
    raised or not, so an engine that fails to start leaves what was measured."""
    import torch

    if worker_class is None:
        from vllm.v1.worker.gpu_worker import Worker as worker_class

    def events() -> list[dict]:
        return torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]

    def traced(name: str, original):
        @functools.wraps(original)
        def method(self, *args, **kwargs):
            start = len(events())
            try:
                return original(self, *args, **kwargs)
            finally:
                with path.open("a", encoding="utf-8") as file:
                    file.write(format_window(window(events(), start, name), top))

        return method

    originals = {name: getattr(worker_class, name) for name in WINDOWS}
    torch.cuda.memory._record_memory_history(max_entries=MAX_EVENTS)
    for name, original in originals.items():
        setattr(worker_class, name, traced(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(worker_class, name, original)
        torch.cuda.memory._record_memory_history(enabled=None)
