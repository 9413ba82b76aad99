"""Trains the built-in benchmark's diffusion model (DDA): a small guided-diffusion UNet on clean Fashion-MNIST.

The code lives in `pcsr_jax/experiments/train_ddpm.py`; this file is its command.
"""

import sys

from pcsr_jax.cli import run_cli
from pcsr_jax.experiments.train_ddpm import main

if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
