"""Where an engine step's time goes: wrappers on one model-runner instance that mark the
start and end of each phase (CUDA events on a GPU, host clocks on CPU).

Installed on the instance (``install``), not on vLLM's classes, and only by the benchmark:
the runner and the plugin stay as they are. Phases, by the runner methods whose calls make
them up:

    target forward   the model's forward (a CUDA-graph replay where vLLM dispatched one)
                     and the target LM head (``model.compute_logits``)
    verify + commit  vLLM's ``_sample`` (the tree verifier under dflash_tfm, vLLM's rejection
                     sampler under dflash) and ``_update_states_after_model_execute`` (the
                     tree commit: KV, GDN and conv states along the accepted path)
    drafting         ``propose_draft_token_ids``: the drafter's forward and LM head, the
                     candidate pools and the tree build

The step itself runs from ``execute_model`` to the end of ``sample_tokens``; what of it no
phase covers (input preparation, metadata, host work between launches) is the rest, which
the benchmark takes against the step's wall period (``speed.py``).

On model runner V2 each step also records the CUDA-graph mode its target forward and its
drafter were dispatched to (the ``dispatch`` of the runner's and the speculator's graph
managers), so that a step time measured without its graphs says so.
"""

from __future__ import annotations

import cProfile
import functools
import io
import pstats
import re
import statistics
import time
from pathlib import Path

import torch

PHASES = ("drafting", "target forward", "verify + commit")
# Each phase call is also a profiler range of this prefix and the phase's name, so that a
# profile can tell which phase launched each kernel (``kernels_by_phase``).
PHASE_RANGE = "phase: "

# Runner attributes (a dotted path from the runner) whose calls make up each phase, by
# model runner: V1 is vllm/v1/worker/gpu_model_runner.py; V2 (vllm/v1/worker/gpu/
# model_runner.py) folds the forward into execute_model and drafts through its speculator.
PHASE_METHODS = {
    "v1": {
        "target forward": ("_model_forward", "model.compute_logits"),
        "verify + commit": ("_sample", "_update_states_after_model_execute"),
        "drafting": ("propose_draft_token_ids",),
    },
    "v2": {
        "verify + commit": ("sample", "postprocess_sampled"),
        "drafting": ("speculator.propose",),
    },
}
# V2 has no forward method of its own to wrap: its execute_model (inputs, forward, LM head)
# stands for the target forward there.
STEP_FORWARD = {"v1": False, "v2": True}


class PhaseTimer:
    """Marks per step while ``recording``; ``collect`` turns them into milliseconds."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.recording = False
        self._steps: list[dict] = []
        self._open: dict | None = None

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _elapsed_ms(self, start, end) -> float:
        if self.cuda:
            return start.elapsed_time(end)
        return (end - start) * 1e3

    def step_started(self, scheduler_output) -> None:
        self._open = None
        if not self.recording:
            return
        spec = scheduler_output.scheduled_spec_decode_tokens
        scheduled = scheduler_output.num_scheduled_tokens
        decode = not scheduler_output.scheduled_new_reqs and all(
            count == 1 + len(spec.get(req_id, ())) for req_id, count in scheduled.items())
        self._open = {"num_reqs": len(scheduled), "decode": decode,
                      "tokens": scheduler_output.total_num_scheduled_tokens,
                      "start": self._mark(), "phases": [], "graphs": set()}

    def step_finished(self) -> None:
        if self._open is not None:
            self._open["end"] = self._mark()
            self._steps.append(self._open)
            self._open = None

    def phase(self, name: str, call, *args, **kwargs):
        step = self._open
        if step is None:
            return call(*args, **kwargs)
        start = self._mark()
        try:
            with torch.profiler.record_function(PHASE_RANGE + name):
                return call(*args, **kwargs)
        finally:
            step["phases"].append((name, start, self._mark()))

    def graph(self, role: str, descriptor) -> None:
        """Note that the open step's ``role`` ran in ``descriptor``'s CUDA-graph mode."""
        if self._open is not None:
            self._open["graphs"].add(f"{role} {descriptor.cg_mode.name}")

    def collect(self) -> list[dict]:
        """The finished steps since the last call: ``num_reqs``, ``decode`` (every request
        scheduled one token plus its drafts), ``tokens``, ``step_ms`` (execute_model to the
        end of sample_tokens), ms per phase and ``graphs`` (sorted "role MODE" labels; V2)."""
        if self.cuda:
            torch.cuda.synchronize()
        steps, self._steps = self._steps, []
        rows = []
        for step in steps:
            row = {"num_reqs": step["num_reqs"], "decode": step["decode"],
                   "tokens": step["tokens"],
                   "step_ms": self._elapsed_ms(step["start"], step["end"]),
                   "graphs": sorted(step["graphs"]), **{name: 0.0 for name in PHASES}}
            for name, start, end in step["phases"]:
                row[name] += self._elapsed_ms(start, end)
            rows.append(row)
        return rows


def kernels_by_phase(events, steps: int, top: int = 12) -> str:
    """A table of the profiled kernels by the phase that launched them (``events``: a torch
    profiler's ``events()`` over ``steps`` recorded steps): per phase its kernels' device
    time per step, then its ``top`` kernels by time, with launches per step. The profiler
    ties a kernel to the host call that launched it, a CUDA-graph replay's kernels to the
    replay, so a graphed phase's kernels count under it; kernels outside every phase range
    (input preparation, graph-less glue) are the rest."""
    by_phase: dict[str, dict[str, list[float]]] = {name: {} for name in (*PHASES, "rest")}
    for event in events:
        if not event.kernels:
            continue
        phase = "rest"
        ancestor = event
        while ancestor is not None:
            if ancestor.name.startswith(PHASE_RANGE):
                phase = ancestor.name[len(PHASE_RANGE):]
                break
            ancestor = ancestor.cpu_parent
        for kernel in event.kernels:
            time_and_count = by_phase[phase].setdefault(kernel.name, [0.0, 0])
            time_and_count[0] += kernel.duration
            time_and_count[1] += 1
    lines = [f"kernels by phase, per step (device us, launches) over {steps} steps:"]
    for phase, kernels in by_phase.items():
        total = sum(time for time, _ in kernels.values())
        launches = sum(count for _, count in kernels.values())
        lines.append(f"  {phase}: {total / steps:.1f} us in {launches / steps:.1f} launches")
        ranked = sorted(kernels.items(), key=lambda item: -item[1][0])[:top]
        lines += [f"    {time / steps:9.1f} {count / steps:6.1f}  {_short_kernel_name(name)}"
                  for name, (time, count) in ranked]
    return "\n".join(lines)


def _short_kernel_name(name: str, width: int = 110) -> str:
    """A kernel name without its namespaces and argument list (torch's elementwise kernels
    differ only in their functor, which is kept), cut to ``width``."""
    short = re.sub(r"^void |at::native::|\(anonymous namespace\)::|std::|c10::", "", name)
    short = short.split(">(")[0] + ">" if ">(" in short else short
    return short if len(short) <= width else short[:width - 3] + "..."


def _owner(runner, path: str):
    *parents, name = path.split(".")
    owner = runner
    for part in parents:
        owner = getattr(owner, part)
    return owner, name


def graph_managers(runner) -> dict[str, list]:
    """Model runner V2's CUDA-graph managers by role: the runner's own for the target, the
    speculator's for the drafter (dflash_tfm's TreeSpeculator holds one per k it drafts and
    round mode)."""
    speculator = getattr(runner, "speculator", None)
    drafting = [getattr(speculator, "query_cudagraph_manager", None),
                *getattr(speculator, "all_draft_graphs", ())]
    by_role = {"target": [runner.cudagraph_manager], "drafting": drafting}
    return {role: list({id(m): m for m in managers if m is not None}.values())
            for role, managers in by_role.items()}


def install(runner, runner_kind: str) -> PhaseTimer:
    """Wrap ``runner``'s phase methods (``PHASE_METHODS[runner_kind]``) and step bounds on
    the instance; returns the timer (also kept as ``runner.bench_phase_timer``)."""
    if runner_kind not in PHASE_METHODS:
        raise ValueError(f"runner must be one of {sorted(PHASE_METHODS)}, got {runner_kind!r}")
    timer = PhaseTimer(cuda=torch.cuda.is_available() and runner.device.type == "cuda")
    execute_model, sample_tokens = runner.execute_model, runner.sample_tokens

    @functools.wraps(execute_model)
    def timed_execute_model(scheduler_output, *args, **kwargs):
        timer.step_started(scheduler_output)
        if STEP_FORWARD[runner_kind]:
            return timer.phase("target forward", execute_model, scheduler_output, *args,
                               **kwargs)
        return execute_model(scheduler_output, *args, **kwargs)

    @functools.wraps(sample_tokens)
    def timed_sample_tokens(*args, **kwargs):
        try:
            return sample_tokens(*args, **kwargs)
        finally:
            timer.step_finished()

    runner.execute_model, runner.sample_tokens = timed_execute_model, timed_sample_tokens
    for name, paths in PHASE_METHODS[runner_kind].items():
        for path in paths:
            owner, attribute = _owner(runner, path)
            if owner is None:  # e.g. no drafter: the phase never runs
                continue
            original = getattr(owner, attribute)
            setattr(owner, attribute, functools.wraps(original)(
                functools.partial(timer.phase, name, original)))
    if runner_kind == "v2":
        for role, managers in graph_managers(runner).items():
            for manager in managers:
                dispatch = manager.dispatch

                def recorded_dispatch(*args, _dispatch=dispatch, _role=role, **kwargs):
                    descriptor = _dispatch(*args, **kwargs)
                    timer.graph(_role, descriptor)
                    return descriptor

                manager.dispatch = functools.wraps(dispatch)(recorded_dispatch)
    runner.bench_phase_timer = timer
    return timer


# Engine-side helpers for `LLM.collective_rpc` (each receives the worker, or its wrapper).
def model_runner_of(worker):
    return getattr(worker, "worker", worker).model_runner


def install_on_worker(worker, runner_kind: str) -> None:
    install(model_runner_of(worker), runner_kind)


def set_recording(worker, on: bool) -> None:
    model_runner_of(worker).bench_phase_timer.recording = on


def collect_steps(worker) -> list[dict]:
    return model_runner_of(worker).bench_phase_timer.collect()


def phase_medians(steps: list[dict]) -> dict:
    """Medians over ``steps`` (``PhaseTimer.collect`` rows) of ``step_ms`` and each phase;
    None each where there are no steps."""
    return {name: statistics.median(step[name] for step in steps) if steps else None
            for name in ("step_ms", *PHASES)}


def profile_file_name(label: str) -> str:
    """A configuration's label as part of its profile's file name."""
    return re.sub(r"[^\w.-]+", "_", label).strip("_")


def profile_engine(llm, run, path: Path, extra: str = "") -> None:
    """Where an engine's time goes while ``run()`` drives it (the runner's phase timer
    installed): ``run`` under cProfile (the host's time by function), then again under
    torch's profiler (kernels: device time against the wall time, which says how
    host-bound the steps are, and by the phase that launched them); the tables and
    ``extra`` to ``path``. Leaves recording off and no marks behind: the profiled steps
    belong to no measurement."""
    from torch.profiler import ProfilerActivity, profile

    host = cProfile.Profile()
    host.enable()
    run()
    host.disable()
    text = io.StringIO()
    stats = pstats.Stats(host, stream=text)
    stats.sort_stats("cumulative").print_stats(80)
    stats.sort_stats("tottime").print_stats(40)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    llm.collective_rpc(collect_steps)
    llm.collective_rpc(set_recording, args=(True,))  # the phases' profiler ranges
    with profile(activities=activities) as trace:
        start = time.perf_counter()
        run()
        wall_ms = (time.perf_counter() - start) * 1e3
    llm.collective_rpc(set_recording, args=(False,))
    steps = max(1, len(llm.collective_rpc(collect_steps)[0]))
    events = trace.key_averages()
    device_ms = sum(event.self_device_time_total for event in events) / 1e3
    text.write(f"\ntorch profiler, {steps} steps: wall {wall_ms:.2f} ms, device (sum of kernel "
               f"self times) {device_ms:.2f} ms\n")
    for key in ("self_device_time_total", "self_cpu_time_total"):
        text.write(events.table(sort_by=key, row_limit=40) + "\n")
    text.write(kernels_by_phase(trace.events(), steps) + "\n" + extra)
    path.write_text(text.getvalue())
