"""CoTTA's augmented teacher views on the built-in benchmark: when they fire, and what they do on their own.

The code lives in `pcsr_jax/experiments/cotta_views.py`; this file is its command.
"""

import sys

from pcsr_jax.cli import run_cli
from pcsr_jax.experiments.cotta_views import main

if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
