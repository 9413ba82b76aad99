"""t-SNE of the last layer's Domain tokens, coloured by corruption (the paper's Fig. 3).

The code lives in `pcsr_jax/experiments/visualize_domain_tokens.py`; this file is its command.
"""

import sys

from pcsr_jax.cli import run_cli
from pcsr_jax.experiments.visualize_domain_tokens import main

if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
