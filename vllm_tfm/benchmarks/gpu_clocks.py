"""The GPU's SM clock and power draw while a benchmark measures.

Step and kernel times compare only at the clocks they ran at: under a model's large GEMMs
an H200 can lower its SM clock to hold its power limit, which slows a latency-bound kernel
(one program per head, a sequential solve) more than the same kernel timed alone. The
sampler reads ``nvidia-smi``'s query loop in a background process, so it costs the
measured process nothing; where ``nvidia-smi`` is absent it reports nothing.
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import subprocess
import threading

# nvidia-smi query fields; older drivers name the last one clocks_throttle_reasons.active.
FIELDS = ("clocks.sm", "clocks.max.sm", "power.draw")
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
SAMPLE_MS = 50


def parse_sample(line: str) -> dict | None:
    """One ``--format=csv,noheader,nounits`` line -> {sm_mhz, max_sm_mhz, power_w, reasons}
    (reasons: the active clock-event bit mask, None where not queried); None for a line
    that is not a sample (a header, an error, "[N/A]" values)."""
    parts = [part.strip() for part in line.split(",")]
    if len(parts) < len(FIELDS):
        return None
    try:
        sm, max_sm, power = (float(part) for part in parts[: len(FIELDS)])
        reasons = int(parts[len(FIELDS)], 16) if len(parts) > len(FIELDS) else None
    except ValueError:
        return None
    return {"sm_mhz": sm, "max_sm_mhz": max_sm, "power_w": power, "reasons": reasons}


def summarize(samples: list[dict]) -> dict | None:
    """Median and lowest SM clock, the maximum clock, median power, and every clock-event
    reason seen (OR of the masks; 0x4 is the power cap), over ``samples``."""
    if not samples:
        return None
    reasons = [s["reasons"] for s in samples if s["reasons"] is not None]
    mask = 0
    for value in reasons:
        mask |= value
    return {
        "samples": len(samples),
        "sm_mhz": statistics.median(s["sm_mhz"] for s in samples),
        "min_sm_mhz": min(s["sm_mhz"] for s in samples),
        "max_sm_mhz": max(s["max_sm_mhz"] for s in samples),
        "power_w": statistics.median(s["power_w"] for s in samples),
        "reasons": f"{mask:#x}" if reasons else None,
    }


@functools.lru_cache(maxsize=None)
def _answered_query(command: str, gpu: str) -> list[str] | None:
    """The nvidia-smi query of the first field set this driver answers (older ones lack
    the event reasons), probed once per process and GPU; None without nvidia-smi."""
    executable = shutil.which(command)
    if executable is None:
        return None
    for reason in (*REASON_FIELDS, None):
        query = [executable, "-i", gpu,
                 "--query-gpu=" + ",".join(FIELDS + ((reason,) if reason else ())),
                 "--format=csv,noheader,nounits"]
        probe = subprocess.run(query, capture_output=True, text=True)
        if probe.returncode == 0 and parse_sample(probe.stdout):
            return query
    return None


def visible_gpu() -> str:
    """nvidia-smi's ``-i`` for CUDA device 0 of this process: the first entry of
    CUDA_VISIBLE_DEVICES (an index or a UUID), else "0"."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


class ClockSampler:
    """``with ClockSampler() as clocks: ...`` then ``clocks.summary`` (:func:`summarize`,
    None without samples). ``gpu``: nvidia-smi's ``-i``."""

    def __init__(self, gpu: str | None = None, command: str = "nvidia-smi"):
        gpu = visible_gpu() if gpu is None else gpu
        self.gpu, self.command = gpu, command
        self.samples: list[dict] = []
        self.summary: dict | None = None
        self._process = None
        self._reader = None

    def __enter__(self) -> ClockSampler:
        query = _answered_query(self.command, self.gpu)
        if query is None:
            return self
        self._process = subprocess.Popen([*query, f"--loop-ms={SAMPLE_MS}"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._process.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append(sample)

    def __exit__(self, *exc) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait()
            self._reader.join()
            self._process.stdout.close()
        self.summary = summarize(self.samples)
