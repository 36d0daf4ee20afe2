"""vllm_tfm.benchmarks.gpu_clocks: nvidia-smi's lines parsed, summarised, and sampled in the
background from a stand-in nvidia-smi (an old driver's field names, a loop that runs
until stopped)."""

import os
import stat
import textwrap
import time

from vllm_tfm.benchmarks.gpu_clocks import ClockSampler, parse_sample, summarize


def test_parse_sample_reads_values_and_skips_what_is_not_a_sample():
    assert parse_sample("1755, 1980, 612.31, 0x0000000000000004\n") == {
        "sm_mhz": 1755.0, "max_sm_mhz": 1980.0, "power_w": 612.31, "reasons": 4}
    assert parse_sample("1980, 1980, 98.5") == {
        "sm_mhz": 1980.0, "max_sm_mhz": 1980.0, "power_w": 98.5, "reasons": None}
    for line in ("", "clocks.current.sm [MHz], clocks.max.sm [MHz], power.draw [W]",
                 "1980, 1980, [N/A]", "Field \"x\" is not a valid field to query."):
        assert parse_sample(line) is None


def test_summarize_takes_medians_and_every_reason_seen():
    samples = [parse_sample(line) for line in
               ("1980, 1980, 300, 0x0", "1500, 1980, 690, 0x4", "1700, 1980, 650, 0x1")]
    assert summarize(samples) == {"samples": 3, "sm_mhz": 1700.0, "min_sm_mhz": 1500.0,
                                  "max_sm_mhz": 1980.0, "power_w": 650.0, "reasons": "0x5"}
    assert summarize([]) is None


def fake_nvidia_smi(directory):
    """Answers only the old field name of the reasons; loops while --loop-ms is given."""
    path = directory / "nvidia-smi"
    path.write_text(textwrap.dedent("""\
        #!/bin/bash
        case "$*" in *clocks_event_reasons*) echo 'Field is not a valid field'; exit 2;; esac
        [[ "$*" == *"-i 3"* ]] || exit 3
        if [[ "$*" == *--loop-ms* ]]; then
          while true; do echo '1600, 1980, 650.5, 0x0000000000000004'; sleep 0.01; done
        fi
        echo '1980, 1980, 90.0, 0x0000000000000000'
        """))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_sampler_reads_the_loop_until_stopped(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    with ClockSampler() as clocks:
        deadline = time.monotonic() + 10
        while len(clocks.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert clocks.summary["samples"] >= 3
    assert clocks.summary["sm_mhz"] == 1600.0 and clocks.summary["reasons"] == "0x4"
    assert clocks._process.poll() is not None  # stopped


def test_sampler_without_nvidia_smi_reports_nothing(tmp_path):
    with ClockSampler(command=str(tmp_path / "absent")) as clocks:
        pass
    assert clocks.summary is None
