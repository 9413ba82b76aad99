"""The built-in table three ways on this host, in one run: one unit at a time with each batch split over the
devices, a unit per device at once in threads (``--devices-per-unit 1``), and a unit per Ray actor at once on a
local Ray instance (``--executor ray``, one actor per core: the Ray way's overhead against the threads). Prints
each way's wall time, its ratio to the first, and whether its records (but their timings) equal the
one-device-per-unit runs'.

    python -m benchmarks.table_parallel                  # Source, TENT, SAR, PCSR; 15 corruptions x 1,280 images
    python -m benchmarks.table_parallel --images 64 --corruptions fog,contrast   # a quick look

On a CPU host the devices are its cores (``--cpu-devices``, one per core; Ray's local instance takes every core of
the host, an actor each); every way is a fresh process of the main job, its compiles included (and for Ray the
instance's start and each actor's set-up), so the figures are what a user's table costs end to end; the corrupted
images are generated into their cache before the first way.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(ROOT, "experiments", "imagenet_c.py")


def _records(out: str) -> list:
  with open(os.path.join(out, "results.json")) as f:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in json.load(f)["records"]]


def _timed(cmds: list[list[str]]) -> float:
  """Runs the commands at once; their wall time (all must succeed)."""
  t0 = time.perf_counter()
  procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for c in cmds]
  errs = [p.communicate()[1] for p in procs]
  for p, e in zip(procs, errs):
    if p.returncode:
      raise SystemExit(f"table_parallel: a run failed (exit {p.returncode}):\n{e[-3000:]}")
  return time.perf_counter() - t0


def _warm_data(corruptions: str | None, images: int) -> None:
  """Fills the built-in benchmark's corrupted-image cache first, so that no way's time includes making it."""
  from pcsr_jax.data.generators import corruptions as corr, fmnist_c
  from pcsr_jax.experiments import builtin

  names = corruptions.split(",") if corruptions else list(corr.BENCHMARK)
  fmnist_c.sources(names, builtin.SEVERITY, images, progress=False, log=lambda *a: None)


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="table_parallel.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--methods", default="source,tent,sar,pcsr")
  p.add_argument("--corruptions", help="default: the built-in benchmark's 15")
  p.add_argument("--images", type=int, default=1280, help="per corruption")
  p.add_argument("--devices", type=int, default=os.cpu_count() or 1, help="devices (CPU: cores) to use")
  p.add_argument("--keep", help="keep the three runs' outputs in this folder")
  a = p.parse_args(argv)
  if a.devices < 1 or a.images < 1:
    p.error(f"--devices and --images must be positive, got {a.devices}, {a.images}")
  work = a.keep or tempfile.mkdtemp(prefix="table_parallel_")
  base = [sys.executable, MAIN, "--methods", a.methods, "--images", str(a.images), "--no-progress"]
  base += ["--corruptions", a.corruptions] if a.corruptions else []
  n = str(a.devices)
  ways = {
      f"one unit at a time, each batch over {n} devices": [base + ["--cpu-devices", n, "--output",
                                                                  os.path.join(work, "split")]],
      f"{n} units at once, one device each": [base + ["--cpu-devices", n, "--devices-per-unit", "1", "--output",
                                                      os.path.join(work, "groups")]],
      f"{n} units at once, a Ray actor each (local instance)": [base + ["--executor", "ray", "--output",
                                                                         os.path.join(work, "ray")]],
  }
  print(f"built-in table: methods {a.methods}, {a.images} images per corruption, {n} devices; outputs in {work}")
  _warm_data(a.corruptions, a.images)
  times = {}
  for name, cmds in ways.items():
    times[name] = _timed(cmds)
    print(f"  {name}: {times[name]:.0f} s", flush=True)
  first = next(iter(times.values()))
  same = _records(os.path.join(work, "groups")) == _records(os.path.join(work, "ray"))
  print("| way | wall s | speed-up over the first |\n|---|---|---|")
  for name, t in times.items():
    print(f"| {name} | {t:.0f} | {first / t:.2f}x |")
  print(f"records of the threads' and Ray's ways equal (timings aside): {same}; the split way's equal "
        f"them: {_records(os.path.join(work, 'split')) == _records(os.path.join(work, 'groups'))}")
  if not a.keep:
    shutil.rmtree(work, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(run_cli(main))
