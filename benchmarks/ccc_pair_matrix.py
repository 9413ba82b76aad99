"""How well CCC's pair matrix estimated from single-corruption curves predicts measured two-corruption accuracy.

    python -m benchmarks.ccc_pair_matrix [--pairs 10] [--images 500]

On the built-in model (``assets/fmnist_vit``) and ``--images`` held-out Fashion-MNIST test images (the
calibration subset `ccc.calibration_split` picks), at integer severities 0..5 and CIFAR-10-C strength: the
single-corruption curves (`ccc.calibrate`), then for ``--pairs`` random ordered pairs of CCC's 14 corruptions
the measured accuracy of every (s1, s2) (corruption 1, then corruption 2 on its output, as `ccc.CCCSource`
applies them) against two estimates: `ccc.pair_matrix` (independent errors, acc1 * acc2 / clean) and the
minimum of the two curves. Prints each pair's mean absolute error and bias, their means, and for targets 20
and 40 % the measured accuracy along the walks `ccc.find_path` picks from each matrix (the figures in
`ccc.pair_matrix`'s docstring; raw output of one run: ``experiments/results/ccc_pair_matrix.txt``).
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from typing import Sequence

import numpy as np

from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser, UserError


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="python -m benchmarks.ccc_pair_matrix", description=__doc__.split("\n\n")[0])
  p.add_argument("--pairs", type=int, default=10, help="random ordered pairs of corruptions")
  p.add_argument("--images", type=int, default=500, help="held-out test images")
  a = p.parse_args(argv)
  if a.pairs < 1 or not 1 <= a.images < 10000:
    raise UserError(f"--pairs must be positive and --images 1..9999, got {a.pairs}, {a.images}")
  import jax
  import jax.numpy as jnp

  from pcsr_jax import checkpoint
  from pcsr_jax.data import fashion_mnist, transforms
  from pcsr_jax.data.generators import ccc, corruptions
  from pcsr_jax.experiments import builtin

  x, y = fashion_mnist.load("test")
  calib, _ = ccc.calibration_split(len(x), a.images, 0)
  xc, yc = x[calib], y[calib]
  model, params, meta = checkpoint.load(builtin.CHECKPOINT, kind="vit")
  pre = transforms.Preprocess.from_meta(meta)
  fwd = jax.jit(lambda im: jnp.argmax(model.apply({"params": params}, im), -1))
  acc = lambda im, lab: 100.0 * float(np.mean(np.asarray(fwd(pre.normalize(im))) == lab))  # noqa: E731

  def corrupt(images, c, s, salt=0):
    return np.stack([corruptions.corrupt(im, c, int(s), 0, i + salt) for i, im in enumerate(images)])

  noises = ccc.NOISES[40]
  t0 = time.time()
  curves = ccc.calibrate(xc, yc, acc, corrupt, noises, np.arange(6.0))
  clean = curves[noises[0]][0]
  print("clean", clean, "curves", round(time.time() - t0, 1), "s", flush=True)
  print(json.dumps({c: [round(v, 1) for v in curves[c]] for c in noises}), flush=True)
  rng = np.random.default_rng(0)
  pairs = [tuple(noises[i] for i in rng.choice(len(noises), 2, replace=False)) for _ in range(a.pairs)]
  rows = []
  inner = (slice(1, None), slice(1, None))
  for c1, c2 in pairs:
    real = np.zeros((6, 6))
    real[:, 0], real[0, :] = curves[c1], curves[c2]
    first = {s1: corrupt(xc, c1, s1) for s1 in range(1, 6)}
    for s1, s2 in itertools.product(range(1, 6), range(1, 6)):
      real[s1, s2] = acc(corrupt(first[s1], c2, s2, salt=10**6), yc)
    estimates = dict(prod=ccc.pair_matrix(curves, c1, c2, clean), min=np.minimum.outer(curves[c1], curves[c2]))
    row = dict(pair=[c1, c2])
    for name, est in estimates.items():
      row[f"{name}_mae"] = float(np.abs(est - real)[inner].mean())
      row[f"{name}_bias"] = float((est - real)[inner].mean())
    for target in (20, 40):
      for name, est in dict(estimates, real=real).items():
        row[f"walk{target}_{name}"] = round(float(np.mean([real[i, j] for i, j in ccc.find_path(est, target)])), 2)
    rows.append(row)
    print(json.dumps(row), round(time.time() - t0, 1), flush=True)
  for k in ("prod_mae", "prod_bias", "min_mae", "min_bias"):
    print(k, round(float(np.mean([r[k] for r in rows])), 2))
  for target in (20, 40):
    for name in ("prod", "min", "real"):
      v = np.array([r[f"walk{target}_{name}"] for r in rows])
      print(f"target {target} {name}: mean real acc on walk {v.mean():.2f}, mean |dev| {np.abs(v - target).mean():.2f}")
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
