"""Seconds to draw MEMO's AugMix views of one image: JAX's two forms and the PyTorch reference's PIL views.

    python -m benchmarks.augmix_views --views 64 --size 224

``augment.augmix_views`` runs its chains one after the other on the CPU (``loop``: each chain step computes
only its own op) and vectorised on accelerators (every op at every step, then a select); this times both on
this machine's default JAX backend, jitted, and ``benchmarks/torch_methods/memo.py``'s ``draw_views`` (PIL,
one view at a time, as MEMO's official code) when torch is installed. Median of ``--reps`` draws (new keys)
after one warm-up call.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Sequence


from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser, UserError


def _median_s(draw: Callable[[int], object], reps: int) -> float:
  draw(0)
  ts = []
  for i in range(reps):
    t0 = time.perf_counter()
    draw(i + 1)
    ts.append(time.perf_counter() - t0)
  return sorted(ts)[reps // 2]


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="augmix_views.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--views", type=int, default=64, help="views per image (MEMO: 64)")
  p.add_argument("--size", type=int, default=224, help="image side in pixels")
  p.add_argument("--reps", type=int, default=3)
  a = p.parse_args(argv)
  if a.views < 1 or a.reps < 1 or a.size < 8:
    raise UserError(f"--views and --reps must be positive and --size at least 8, got {a.views}, {a.reps}, "
                    f"{a.size}")
  import jax

  from pcsr_jax import augment

  img = jax.random.uniform(jax.random.key(0), (a.size, a.size, 3))
  print(f"AugMix views of one {a.size}x{a.size} image, {a.views} views, {os.cpu_count()} cores; seconds per "
        f"image (median of {a.reps})")
  for loop in (True, False):
    f = jax.jit(lambda k, x, loop=loop: augment.augmix_views(k, x, a.views, loop=loop))
    s = _median_s(lambda i: f(jax.random.key(i), img).block_until_ready(), a.reps)
    label = f"jax [{jax.default_backend()}], {'loop' if loop else 'vectorised'}"
    print(f"  {label:28s}{s:8.3f}", flush=True)
  try:
    import torch

    from benchmarks.torch_methods.memo import Reference
  except ImportError:
    print("  torch: not installed (pip install -e '.[convert]')")
    return 0
  ref = Reference(torch.nn.Identity(), 1, views=a.views)
  x = torch.rand(3, a.size, a.size) * 2 - 1  # a normalised image (mean = std = 0.5)
  s = _median_s(lambda i: ref.draw_views(x), a.reps)
  label = f"torch [PIL, {torch.get_num_threads()} threads]"
  print(f"  {label:28s}{s:8.3f}")
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
