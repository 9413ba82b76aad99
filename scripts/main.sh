#!/usr/bin/env bash
# The main job on a fresh machine: the virtual environment (.venv), the core package (jax, flax, optax, orbax,
# tfds; no torch) and the built-in data, then `python experiments/imagenet_c.py` with the arguments given
# (none: the built-in Fashion-MNIST-C benchmark, about three minutes on an idle 2-core CPU), and how to run again.
. "$(dirname "$0")/env.sh"
python -m pip install -q -e .
python experiments/imagenet_c.py "$@"
echo "== to run again: '. .venv/bin/activate', then 'python experiments/imagenet_c.py ARGS' (or 'bash scripts/main.sh ARGS')"
