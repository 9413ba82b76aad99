"""The paper's ablations on ImageNet-C severity 5 (PCSR only): Tables 3-5 and the learning-rate sweep.

The code lives in `pcsr_jax/experiments/ablations.py`; this file is its command.
"""

import sys

from pcsr_jax.cli import run_cli
from pcsr_jax.experiments.ablations import main

if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
