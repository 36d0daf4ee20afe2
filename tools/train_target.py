"""Train the tiny Qwen3-Next target as a language model of Python's standard-library sources.

Usage and options: the docstring of vllm_tfm/training/train_target.py, or --help.
"""

from vllm_tfm.training.train_target import main

if __name__ == "__main__":
    main()
