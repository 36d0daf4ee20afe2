"""Build the site-packages training corpus, split by package, with its tokenizer and manifest.

Usage and options: the docstring of vllm_tfm/training/corpus.py, or --help.
"""

from vllm_tfm.training.corpus import main

if __name__ == "__main__":
    main()
