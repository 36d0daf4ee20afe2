"""Throughput of feature generation and DFlash / Weaver training at a real target's shapes.

Usage and options: the docstring of vllm_tfm/training/bench_training.py, or --help.
"""

from vllm_tfm.training.bench_training import main

if __name__ == "__main__":
    main()
