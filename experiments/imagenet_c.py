"""Main job: online test-time adaptation on ImageNet-C, printing the paper's Table 1 layout.

The code lives in `pcsr_jax/experiments/imagenet_c.py`; this file is its command.
"""

import sys

from pcsr_jax.cli import run_cli
from pcsr_jax.experiments.imagenet_c import main

if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
