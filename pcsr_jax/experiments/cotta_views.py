"""CoTTA's augmented teacher views on the built-in benchmark: when they fire, and what they do on their own.

    python experiments/cotta_views.py [--images 1280] [--corruptions brightness,fog]

CoTTA's anchor is the frozen source model, so whether a batch's teacher prediction is the average over the
32 augmented views (batch mean of the anchor's max probability below ``ap``) depends on the source model and
the batch alone, never on the adaptation. Per corruption, over the batches of the default run (the harness's
stream: seed 2022, batch 64, the first ``--images`` test images shuffled), this prints the range of that mean
and how many batches fall below ``ap`` (0.92, `builtin.COTTA_AP`). On the first batch CoTTA's teacher is still
the source, so its prediction there is the source's logits averaged over the views: the accuracy of both is
printed (the views drawn from seed 0; a run draws its own, so a figure can differ by a few images).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pcsr_jax import checkpoint, methods
from pcsr_jax.data.generators import corruptions as corr
from pcsr_jax.data import streams, transforms
from pcsr_jax.data.generators import fmnist_c
from pcsr_jax.errors import ArgumentParser, UserError
from pcsr_jax.experiments import builtin


def main(argv: Sequence[str]) -> None:
  p = ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--images", type=int, default=builtin.DEFAULT_IMAGES, help="per corruption (default 1280)")
  p.add_argument("--corruptions", default=None, help="comma-separated (default: the 15 benchmark ones)")
  p.add_argument("--seed", type=int, default=builtin.DEFAULT_SEEDS[0], help="the stream's seed (2022)")
  a = p.parse_args(argv)
  if a.images < 1:
    raise UserError(f"--images: expected a positive integer, got {a.images}")
  names = a.corruptions.split(",") if a.corruptions else list(corr.BENCHMARK)
  unknown = [n for n in names if n not in corr.ALL]
  if unknown:
    raise UserError(f"--corruptions: unknown {', '.join(unknown)}; expected names from {', '.join(corr.ALL)}")
  model, params, meta = checkpoint.load(builtin.CHECKPOINT)
  cotta = methods.get("cotta", ap=builtin.COTTA_AP, mean=tuple(meta["mean"]), std=tuple(meta["std"]))
  logits = jax.jit(lambda x: model.apply({"params": params}, x))
  views = jax.jit(lambda k, x: jnp.mean(jax.lax.map(lambda kk: logits(cotta.augment(kk, x)),
                                                    jax.random.split(k, cotta.n_aug)), axis=0))
  srcs = fmnist_c.sources(names, builtin.SEVERITY, a.images, log=lambda *_: None)
  segs = streams.build("normal", [len(s) for _, s in srcs], [s.labels for _, s in srcs], names, a.seed)
  b = builtin.BATCH_SIZE
  print(f"{'corruption':<20} {'anchor conf min':>15} {'max':>6} {'fired':>7}   batch 1: {'source':>6} {'views':>6}")
  for (name, src), seg in zip(srcs, segs):
    confs = []
    for i in range(0, len(seg.indices), b):
      idx = seg.indices[i:i + b]
      x = transforms.normalize(src.images[idx], meta["mean"], meta["std"])
      out = logits(x)
      confs.append(float(jnp.mean(jnp.max(jax.nn.softmax(out, -1), -1))))
      if i == 0:
        y = src.labels[idx]
        acc_src = 100 * np.mean(np.asarray(out.argmax(-1)) == y)
        acc_views = 100 * np.mean(np.asarray(views(jax.random.key(0), x).argmax(-1)) == y)
    fired = sum(c < cotta.ap for c in confs)
    print(f"{name:<20} {min(confs):>15.3f} {max(confs):>6.3f} {fired:>3}/{len(confs):<3}   "
          f"{'':>8} {acc_src:>6.1f} {acc_views:>6.1f}")
