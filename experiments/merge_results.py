"""One table from several finished runs of the same stream (mean ± std over seeds, img/s per method).

The code lives in `pcsr_jax/experiments/merge_results.py`; this file is its command.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this clone's package
from pcsr_jax.cli import run_cli  # noqa: E402 -- the standard library only: a Python without jax gets one line

if __name__ == "__main__":
  run_cli("pcsr_jax.experiments.merge_results:main", sys.argv[1:])
