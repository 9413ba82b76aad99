"""DePT-G's source stage: prompts, head and DINO heads trained on clean source data for a checkpoint.

The code lives in `pcsr_jax/experiments/train_prompts.py`; this file is its command.
"""

import sys

from pcsr_jax.cli import run_cli
from pcsr_jax.experiments.train_prompts import main

if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
