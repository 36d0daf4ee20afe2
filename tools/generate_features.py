"""Run a target over prompts and its own continuations; store what drafter training reads.

Usage and options: the docstring of vllm_tfm/training/generate_features.py, or --help.
"""

from vllm_tfm.training.generate_features import main

if __name__ == "__main__":
    main()
