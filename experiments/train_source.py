"""Trains the built-in benchmark's source model: a small ViT on clean Fashion-MNIST.

The code lives in `pcsr_jax/experiments/train_source.py`; this file is its command.
"""

import sys

from pcsr_jax.cli import run_cli
from pcsr_jax.experiments.train_source import main

if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
