#!/usr/bin/env bash
# The main job on a fresh machine: the virtual environment (.venv), the core package (jax, flax, optax, orbax,
# tfds; no torch) and the built-in data, then `python experiments/imagenet_c.py` with the arguments given
# (none: the built-in Fashion-MNIST-C benchmark, about three minutes on a 2-core CPU).
. "$(dirname "$0")/env.sh"
python -m pip install -q -e .
exec python experiments/imagenet_c.py "$@"
