"""Train a DFlash drafter for a frozen target (DESIGN.md section 2).

Usage and options: the docstring of vllm_tfm/training/train_dflash.py, or --help.
"""

from vllm_tfm.training.train_dflash import main

if __name__ == "__main__":
    main()
