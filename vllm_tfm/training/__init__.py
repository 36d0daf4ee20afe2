"""Training and evaluation of the tiny family's models: the library behind tools/train_*.py and
tools/eval_acceptance.py (thin command lines over the `train_*` / `eval_acceptance` modules).
Not imported by `vllm_tfm` itself; the drafting core never imports it. transformers loads
inside functions; eval_acceptance draws its plot with matplotlib (the `train` extra).

Modules:
    data        standard-library text (training / held-out modules), target-generated
                continuations and their on-disk cache.
    target      the frozen target through transformers (fla hidden): per-position features,
                incremental decoding and exact scoring of draft trees.
    dflash      a PyTorch DFlash drafter that reads and writes vLLM's `dflash` checkpoints,
                its block-diffusion training loss.
    weaver_lk   Weaver teacher forcing with gradients, candidate pools, the LK loss.
    acceptance  decoding simulations that measure mean accepted length with the engine's
                tree builders and verifiers.
    loop        device choice, optimiser + schedule, resumable checkpoints, progress.

Commands (each a `main(argv)`, usage in its docstring):
    train_target     the Qwen3-Next target, next-token loss on the standard library.
    train_dflash     the DFlash drafter against a trained target.
    train_weaver     the Weaver against a trained target and drafter (LK loss).
    train_family     the three stages in order with the committed family's recipe, manifest.
    eval_acceptance  mean accepted length by tree kind and budget, by decoding simulation.
"""
