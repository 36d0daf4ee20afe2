"""The tiny model family and the engine runs on it (tests, demo, benchmarks, GPU checks).

Modules:
    family       builds (deterministic, cached by build hash) and loads the tiny family:
                 tokenizer, Qwen3-Next hybrid target, DFlash drafter, Weaver; loads the
                 committed trained family (models/tiny_trained) against its manifest.
    engine_runs  runs vLLM engines (CPU settings) and transformers on a family, in this
                 process or a fresh one; compares greedy runs up to bf16 ties; times runs and
                 reads the mean accepted length.
    gpu_checks   the end-to-end check on a CUDA GPU (tools/gpu_e2e.py): its dense hybrid
                 models, kernel-launch and CUDA-graph counters, engine runs and report.

Nothing here is imported by `vllm_tfm` itself; vLLM is imported inside the functions that
start engines.
"""
