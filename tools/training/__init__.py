"""Shared pieces of the training and evaluation tools (tools/train_*.py, tools/eval_acceptance.py).

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
"""
