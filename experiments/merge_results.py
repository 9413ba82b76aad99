"""One table from several finished runs of the same stream (mean ± std over seeds, img/s per method).

The code lives in `pcsr_jax/experiments/merge_results.py`; this file is its command.
"""

import sys

from pcsr_jax.cli import run_cli
from pcsr_jax.experiments.merge_results import main

if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
