"""Computes the source statistics of the methods that need them (EATA, CFA, FOA), once.

The code lives in `pcsr_jax/experiments/source_stats.py`; this file is its command.
"""

import sys

from pcsr_jax.cli import run_cli
from pcsr_jax.experiments.source_stats import main

if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
