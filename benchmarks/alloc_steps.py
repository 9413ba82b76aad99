"""What the allocator costs JAX's step on a CPU: wall, user and kernel seconds, page faults and memory per step.

    PCSR_JAX_MALLOC=hugepages python -m benchmarks.alloc_steps --method eta,tent --batch-size 16

Runs like every command under `pcsr_jax.malloc`'s allocator (``PCSR_JAX_MALLOC``: mimalloc by default where
installed, ``hugepages``, ``reuse``, ``system``) and prints, for each method's step after its first and
``--warmup`` more, every timed step's wall seconds, the process's user and kernel (system) CPU seconds and minor
page faults during it, and the resident memory after it, then the peak. Why: XLA:CPU allocates a step's
temporaries as one block per device; under glibc's defaults every step maps, faults in and zeroes that block
afresh, and the kernel's share of a step is what an allocator changes. Wall times drift on a shared machine;
the kernel seconds and the faults are the allocator's own cost. One process, methods one after the other.

Each method's first line gives its step's temporaries per device (XLA's memory analysis of the compiled step),
the block the allocator serves at every step, and says when it is above mimalloc's 2 GiB default
``arena_max_object_size`` (blocks above it went to the OS at every step until `pcsr_jax.malloc` raised the
limit). ``--steps 0`` prints only that line (the step compiled, not run).
"""

from __future__ import annotations

import resource
import statistics
import sys
from typing import Sequence

from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser


def parser() -> ArgumentParser:
  p = ArgumentParser(prog="alloc_steps.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--arch", default="vit_small_patch16_224")
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--method", default="tent", help="a registered method, a comma-separated list, or 'all'")
  p.add_argument("--steps", type=int, default=5, help="timed steps of each method (0: only the step's memory)")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps of each method after its first")
  p.add_argument("--cpu-devices", type=int, help="split the CPU into N JAX devices (default as step_throughput.py's: "
                 "one per core on a CPU-only host)")
  p.add_argument("--row-chunk", type=int, help="run the model in passes of N rows (the harness's --row-chunk)")
  return p


ARENA_DEFAULT_GIB = 2  # mimalloc 3.x's arena_max_object_size: larger blocks come from the OS (mmap, munmap)


def allocator() -> str:
  """The allocator this process runs under, as `pcsr_jax.malloc` set it."""
  from benchmarks.step_throughput import _malloc_note

  return _malloc_note().lstrip(", ") or "glibc's defaults"


def main(argv: Sequence[str] | None = None) -> int:
  a = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
  from benchmarks import step_throughput as st

  st.check_counts(a, batch_size=1, steps=0, warmup=0, row_chunk=1)
  from pcsr_jax import engine
  from pcsr_jax.models import get_config

  get_config(a.arch)
  chosen = st.chosen_methods(a.method)
  engine.use_cpu_devices(a.cpu_devices if a.cpu_devices is not None else st.default_cpu_devices(a.batch_size))
  import time

  import jax

  model, params, x = st.jax_inputs(a.arch, a.batch_size)
  print(f"{a.arch}, batch {a.batch_size}, {len(jax.devices())} JAX device(s), allocator: {allocator()}")
  for m in chosen:
    step, sync, ad, placed, box = st.jax_step(m, model, params, x, row_chunk=a.row_chunk)
    temps = ad.lower(box["state"], placed).compile().memory_analysis().temp_size_in_bytes
    print(f"{m}: temporaries {temps / 2**30:.2f} GiB per device"
          + (f" (above mimalloc's default arena limit, {ARENA_DEFAULT_GIB} GiB)" if temps > ARENA_DEFAULT_GIB * 2**30
             else ""))
    if a.steps == 0:
      continue
    for _ in range(1 + a.warmup):
      step()
      sync()
    rows = []
    for _ in range(a.steps):
      r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
      step()
      sync()
      wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
      rows.append((wall, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt,
                   st.rss_mb()))
    cols = list(zip(*rows))
    print(f"{m}: median wall {statistics.median(cols[0]):.2f} s, kernel {statistics.median(cols[2]):.2f} s, "
          f"faults {statistics.median(cols[3]):.0f} per step; peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    for name, col, fmt in (("wall s", cols[0], "{:.2f}"), ("user s", cols[1], "{:.2f}"),
                           ("kernel s", cols[2], "{:.2f}"), ("faults", cols[3], "{:.0f}"),
                           ("RSS MiB", cols[4], "{:.0f}")):
      print(f"  {name:9s}" + " ".join(fmt.format(v) for v in col))
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
