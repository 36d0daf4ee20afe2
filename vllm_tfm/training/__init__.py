"""Training and evaluation of drafters (DFlash, Weaver) for a target: the library behind
tools/generate_features.py, tools/train_*.py, tools/bench_training.py and
tools/eval_acceptance.py (thin command lines over the modules of the same names). Not
imported by `vllm_tfm` itself; the drafting core never imports it. transformers loads
inside functions; the plots use matplotlib (the `train` extra).

The path: `generate_features` runs the target once and stores its features; `train_dflash`
and `train_weaver` read them and the target's embedding and LM head only, on one process
or several (torchrun).

Modules:
    data        prompt sources (standard-library text with training / held-out modules,
                JSON-lines texts, random ids) and target-generated continuations.
    target      the frozen target through transformers (fla hidden on CPU, fla's kernels
                on CUDA): per-position features, incremental decoding, exact scoring.
    features    the stored-feature format: shards, manifest, the target's head, readers.
    dflash      a PyTorch DFlash drafter that reads and writes vLLM's `dflash` checkpoints,
                its block-diffusion training loss.
    weaver_lk   Weaver teacher forcing with gradients, candidate pools, the LK loss.
    acceptance  decoding simulations that measure mean accepted length with the engine's
                tree builders and verifiers.
    loop        options, device and processes (DDP), optimiser + schedule, resumable
                checkpoints, the training loop, loss and acceptance curves.

Commands (each a `main(argv)`, usage in its docstring):
    generate_features  target continuations and features, sharded, resumable.
    train_target     the Qwen3-Next target, next-token loss on the standard library.
    train_dflash     the DFlash drafter from stored features.
    train_weaver     the Weaver from stored features and a trained drafter (LK loss).
    train_family     the tiny family's recipe: target, features, drafter, Weaver, manifest.
    bench_training   the three steps timed at Qwen3.6-27B shapes (random weights).
    eval_acceptance  mean accepted length by tree kind and budget, by decoding simulation.
"""
