"""Tree builders compared on the same contexts, by the verifier's exact expected accepted length.

Usage and options: the docstring of vllm_tfm/training/paired_trees.py, or --help.
"""

from vllm_tfm.training.paired_trees import main

if __name__ == "__main__":
    main()
