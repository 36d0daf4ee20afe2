"""Train the tiny family end to end: target, DFlash drafter, Weaver; write it with a manifest.

Usage and options: the docstring of vllm_tfm/training/train_family.py, or --help.
"""

from vllm_tfm.training.train_family import main

if __name__ == "__main__":
    main()
