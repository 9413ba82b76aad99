"""The paper's label-shift (L.S.) and mixed-shift (M.S.) table on ImageNet-C, severity 5.

The code lives in `pcsr_jax/experiments/wild.py`; this file is its command.
"""

import sys

from pcsr_jax.cli import run_cli
from pcsr_jax.experiments.wild import main

if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
