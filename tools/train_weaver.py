"""Train a Weaver on a frozen target + frozen DFlash drafter with the LK loss (DESIGN.md section 3).

Usage and options: the docstring of vllm_tfm/training/train_weaver.py, or --help.
"""

from vllm_tfm.training.train_weaver import main

if __name__ == "__main__":
    main()
