"""CoTTA's augmented teacher views on the built-in benchmark: when they fire, and what they do on their own.

The code lives in `pcsr_jax/experiments/cotta_views.py`; this file is its command.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this clone's package
from pcsr_jax.cli import run_cli  # noqa: E402 -- the standard library only: a Python without jax gets one line

if __name__ == "__main__":
  run_cli("pcsr_jax.experiments.cotta_views:main", sys.argv[1:])
