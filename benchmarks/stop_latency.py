"""How fast a stop lands: starts the main job on the built-in benchmark (by default MEMO, whose steps are long),
sends SIGINT after ``--delay`` seconds, and prints the seconds from the signal to the first line the run prints
after it and to the run's exit, with its exit code (130: stopped, progress saved).

    python -m benchmarks.stop_latency                       # MEMO on fog, 1,280 images, SIGINT after 40 s
    python -m benchmarks.stop_latency --methods tent --delay 10

The run is a fresh process of the main job (its compiles included), so the delay must reach past its start-up
for the signal to land inside a step; the lines printed before the signal are shown to say where it landed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence

from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(ROOT, "experiments", "imagenet_c.py")


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="stop_latency.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--methods", default="memo")
  p.add_argument("--corruptions", default="fog")
  p.add_argument("--images", type=int, default=1280, help="per corruption")
  p.add_argument("--delay", type=float, default=40.0, help="seconds from the start to SIGINT")
  a = p.parse_args(argv)
  if a.delay <= 0 or a.images < 1:
    p.error(f"--delay and --images must be positive, got {a.delay}, {a.images}")
  out = tempfile.mkdtemp(prefix="stop_latency_")
  cmd = [sys.executable, MAIN, "--methods", a.methods, "--corruptions", a.corruptions, "--images", str(a.images),
         "--output", out, "--checkpoint-every", "1000", "--no-progress"]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
  lines: list[tuple[float, str]] = []

  def read() -> None:
    for line in proc.stdout:
      lines.append((time.monotonic(), line.rstrip()))

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  time.sleep(a.delay)
  t0 = time.monotonic()
  proc.send_signal(signal.SIGINT)
  proc.wait()
  end = time.monotonic()
  reader.join(5)
  before = [line for t, line in lines if t < t0]
  after = [(t - t0, line) for t, line in lines if t >= t0]
  print(f"{' '.join(cmd[1:])}\nSIGINT after {a.delay:g} s; last lines before it:")
  for line in before[-3:]:
    print(f"  {line}")
  first = f"{after[0][0]:.1f} s ({after[0][1]})" if after else "none"
  print(f"first line after SIGINT: {first}\nexit {proc.returncode} after {end - t0:.1f} s; outputs in {out}")
  return 0


if __name__ == "__main__":
  sys.exit(run_cli(main))
