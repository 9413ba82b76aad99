"""Hyperparameter sweep of the built-in benchmark, on the 4 held-out corruptions only.

The code lives in `pcsr_jax/experiments/tune_builtin.py`; this file is its command.
"""

import sys

from pcsr_jax.cli import run_cli
from pcsr_jax.experiments.tune_builtin import main

if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
