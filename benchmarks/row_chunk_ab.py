"""JAX's step under several ``--row-chunk`` settings, timed in one process, their steps alternating.

    python -m benchmarks.row_chunk_ab --arch vit_small_patch16_224 --batch-size 16 --method tent --cpu-devices 2 \
        --row-chunk none,8,4

Why: on a shared CPU one process's speed drifts by 10-30% from minute to minute (`step_throughput.py`), more
than the settings differ, so two runs one after the other cannot tell them apart. Here every setting's step is
compiled in the same process and the timed steps go round robin (one step of each setting, then again), so a
slow spell lands on every setting alike. Prints each setting's median step time and its speed relative to the
first setting.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Optional, Sequence

from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser, UserError


def parse_chunks(text: str) -> list[Optional[int]]:
  """``--row-chunk``: comma-separated rows per pass, ``none`` for one pass; at least two settings."""
  chunks: list[Optional[int]] = []
  for item in (t.strip() for t in text.split(",")):
    if item == "none":
      chunks.append(None)
    elif item.isdigit() and int(item) >= 1:
      chunks.append(int(item))
    else:
      raise UserError(f"--row-chunk: expected positive integers or 'none', comma-separated, got '{item}'")
  if len(chunks) < 2 or len(set(chunks)) != len(chunks):
    raise UserError(f"--row-chunk: expected at least two different settings, got '{text}'")
  return chunks


def parser() -> ArgumentParser:
  p = ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--arch", default="vit_small_patch16_224")
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--method", default="tent", help="one registered method")
  p.add_argument("--cpu-devices", type=int, help="split the CPU into N JAX devices (as the harness flag; "
                 "default as step_throughput.py's: one per core on a CPU-only host)")
  p.add_argument("--row-chunk", default="none,8", help="settings to compare, e.g. none,8,4 (the first: the base)")
  p.add_argument("--steps", type=int, default=8, help="timed steps of each setting")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps of each setting after its compile")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  a = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
  chunks = parse_chunks(a.row_chunk)
  from benchmarks import step_throughput as st

  st.check_counts(a, batch_size=1, steps=1, warmup=0)
  from pcsr_jax import engine, methods
  from pcsr_jax.methods.rows import splits_into_passes
  from pcsr_jax.models import get_config

  get_config(a.arch)
  methods.get(a.method)
  cpu_devices = a.cpu_devices if a.cpu_devices is not None else st.default_cpu_devices(a.batch_size)
  engine.use_cpu_devices(cpu_devices)  # first: it checks the count
  devices = cpu_devices or 1
  for c in chunks:  # `methods.rows.in_row_passes` would quietly run any other setting as one pass
    if c is not None and not splits_into_passes(a.batch_size, c, devices):
      raise UserError(f"--row-chunk: {c} rows per pass must be below and divide --batch-size {a.batch_size}, "
                      f"and split over {devices} device(s)")
  model, params, x = st.jax_inputs(a.arch, a.batch_size)
  steps = {}
  for c in chunks:
    step, sync, *_ = st.jax_step(a.method, model, params, x, row_chunk=c)
    for _ in range(1 + a.warmup):
      step()
      sync()
    steps[c] = (step, sync)
  times: dict[Optional[int], list[float]] = {c: [] for c in chunks}
  for _ in range(a.steps):
    for c in chunks:
      step, sync = steps[c]
      t0 = time.perf_counter()
      step()
      sync()
      times[c].append(time.perf_counter() - t0)
  base = statistics.median(times[chunks[0]])
  print(f"{a.method} step, {a.arch}, batch {a.batch_size}, {devices} device(s), {a.steps} steps of "
        f"each setting in turn")
  for c in chunks:
    m = statistics.median(times[c])
    name = "one pass" if c is None else f"{c} rows per pass"
    print(f"  {name:18s} median {1e3 * m:8.1f} ms ({a.batch_size / m:7.2f} img/s), {base / m:5.3f}x the first; "
          f"range {1e3 * min(times[c]):.1f}-{1e3 * max(times[c]):.1f} ms")
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
