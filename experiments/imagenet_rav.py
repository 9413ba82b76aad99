"""The paper's Table 2: ImageNet -> ImageNet-R, ImageNet-A and VisDA-2021.

The code lives in `pcsr_jax/experiments/imagenet_rav.py`; this file is its command.
"""

import sys

from pcsr_jax.cli import run_cli
from pcsr_jax.experiments.imagenet_rav import main

if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
