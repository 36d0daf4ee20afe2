"""Mean accepted length of chain DFlash, DDTree(B) and Weaver(B) trees on a prompt set.

Usage and options: the docstring of vllm_tfm/training/eval_acceptance.py, or --help.
"""

from vllm_tfm.training.eval_acceptance import main

if __name__ == "__main__":
    main()
