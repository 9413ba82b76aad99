"""GFLOP/s of the attention's batched matmuls, JAX vs PyTorch, and JAX pinned to one core.

    python -m benchmarks.batched_matmul --batch 96 --tokens 197 --head-dim 64

Why: on XLA:CPU a batched ``dot`` (``[B, T, Dh] x [B, Dh, T]``, the attention's ``Q K^T`` and ``A V`` with
B = images x heads) runs on one thread. This prints, for ``Q K^T``, ``A V`` and ``A^T dO``, JAX on all cores,
JAX pinned to core 0 (the same figure means one thread) and PyTorch's ``bmm`` on all cores. Each
configuration runs in its own subprocess; median of ``--reps`` calls after two warm-ups.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser, UserError

PRODUCTS = ("q k^T", "a v", "a^T do")


def _median_ms(fn, reps: int) -> float:
  fn()
  fn()
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t0)
  return 1e3 * sorted(ts)[reps // 2]


def worker(framework: str, b: int, t: int, d: int, reps: int) -> dict:
  """ms per product for one framework in this process."""
  if framework == "jax":
    import jax
    import jax.numpy as jnp

    q, p = jnp.ones((b, t, d)), jnp.ones((b, t, t))
    fns = {"q k^T": jax.jit(lambda q: jnp.matmul(q, jnp.swapaxes(q, -1, -2))),
           "a v": jax.jit(lambda p, v: jnp.matmul(p, v)),
           "a^T do": jax.jit(lambda p, v: jnp.matmul(jnp.swapaxes(p, -1, -2), v))}
    args = {"q k^T": (q,), "a v": (p, q), "a^T do": (p, q)}
    return {k: _median_ms(lambda k=k: fns[k](*args[k]).block_until_ready(), reps) for k in PRODUCTS}
  import torch

  q, p = torch.ones(b, t, d), torch.ones(b, t, t)
  fns = {"q k^T": lambda: torch.bmm(q, q.transpose(1, 2)), "a v": lambda: torch.bmm(p, q),
         "a^T do": lambda: torch.bmm(p.transpose(1, 2), q)}
  return {k: _median_ms(fns[k], reps) for k in PRODUCTS}


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="batched_matmul.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--batch", type=int, default=96, help="images x heads (default 96: 16 images, ViT-S's 6 heads)")
  p.add_argument("--tokens", type=int, default=197)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--frameworks", default="jax,jax-one-core,torch")
  p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one framework in this process
  a = p.parse_args(argv)
  if min(a.batch, a.tokens, a.head_dim, a.reps) < 1:
    raise UserError("--batch, --tokens, --head-dim and --reps must be positive")
  if a.worker:
    if a.worker == "jax-one-core":
      os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    print(json.dumps(worker("torch" if a.worker == "torch" else "jax", a.batch, a.tokens, a.head_dim, a.reps)))
    return 0
  gflop = {"q k^T": 2 * a.batch * a.tokens * a.tokens * a.head_dim / 1e9}
  gflop["a v"] = gflop["a^T do"] = gflop["q k^T"]
  print(f"batched matmuls [{a.batch}, {a.tokens}, {a.head_dim}], float32, {os.cpu_count()} cores; GFLOP/s "
        f"(ms)")
  print(f"  {'':14s}" + "".join(f"{k:>18s}" for k in PRODUCTS))
  for fw in [f.strip() for f in a.frameworks.split(",") if f.strip()]:
    if fw not in ("jax", "jax-one-core", "torch"):
      raise UserError(f"--frameworks: unknown '{fw}' (expected jax, jax-one-core, torch)")
    argv_w = [sys.executable, "-m", "benchmarks.batched_matmul", "--batch", str(a.batch), "--tokens", str(a.tokens),
              "--head-dim", str(a.head_dim), "--reps", str(a.reps), "--worker", fw]
    r = subprocess.run(argv_w, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
      raise UserError(f"{fw} worker failed: {(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    ms = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"  {fw:14s}" + "".join(f"{gflop[k] / ms[k] * 1e3:9.0f} ({ms[k]:5.2f})" for k in PRODUCTS), flush=True)
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
